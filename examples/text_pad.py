"""Variable-length text: pad each batch to its longest sentence with ``Pad``.

    python examples/text_pad.py                 # a tiny generated corpus, seconds
    python examples/text_pad.py --corpus FILE   # one sentence per line; label = first word

Each sample is (token ids as an int32 array of its own length, label).
``Tuple(Pad(val=0, ret_length=True), Stack())`` pads the token arrays of a
batch to its longest one (in the workers, straight into shared memory) and
returns the lengths, which a model uses to mask the padding.  Sorting samples
by length inside buckets (``--bucket``) cuts the padding: the example prints
how much of each batch is padding either way.  numpy only.
"""
from __future__ import annotations

import argparse

import numpy as np

import mxload
from mxload.batchify import Pad, Stack, Tuple

WORDS = ("the a cat dog sat ran on under mat rug quickly slowly big small red blue and then it "
         "was home far near").split()


class Sentences(mxload.Dataset):
    """(token ids, label) per sentence; ids index a vocabulary built from the corpus."""

    def __init__(self, lines: list[str]):
        self.vocab = {w: i + 1 for i, w in enumerate(sorted({w for line in lines for w in line.split()}))}
        self.tokens = [np.array([self.vocab[w] for w in line.split()], np.int32) for line in lines]
        self.labels = [len(line.split()) % 2 for line in lines]   # a toy target: odd or even length

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[i], self.labels[i]


def make_corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(n)]


def bucketed_batches(lengths: list[int], batch_size: int, seed: int = 0) -> list[list[int]]:
    """Batches of similar lengths: shuffle, cut into chunks of 20 batches,
    sort each chunk by length, then shuffle the batches."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    chunk = 20 * batch_size
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk].tolist(), key=lambda i: lengths[i])
        batches += [part[k:k + batch_size] for k in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="a text file, one sentence per line (default: generated)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bucket", action="store_true", help="batch sentences of similar length")
    args = parser.parse_args()
    if args.corpus:
        with open(args.corpus) as f:
            lines = [line.strip() for line in f if line.strip()]
    else:
        lines = make_corpus()
    dataset = Sentences(lines)
    batchify = Tuple(Pad(val=0, ret_length=True), Stack())
    for bucket in ([False, True] if not args.bucket else [True]):
        if bucket:
            batches = bucketed_batches([len(t) for t in dataset.tokens], args.batch_size)
            loader = mxload.DataLoader(dataset, batch_sampler=batches, batchify_fn=batchify,
                                       num_workers=args.workers)
        else:
            loader = mxload.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, seed=0,
                                       batchify_fn=batchify, num_workers=args.workers)
        real = padded = 0
        for k, ((tokens, lengths), labels) in enumerate(loader):
            assert tokens.shape == (len(lengths), int(lengths.max()))
            assert (tokens[np.arange(tokens.shape[1]) >= lengths[:, None]] == 0).all()   # the padding
            if k == 0:
                print(f"first batch: tokens {tokens.shape} {tokens.dtype}, "
                      f"lengths {lengths[:6].tolist()}..., labels {labels[:6].tolist()}...")
            real += int(lengths.sum())
            padded += tokens.size
        print(f"{'bucketed' if bucket else 'shuffled'} batches: {len(loader)} batches, "
              f"{1 - real / padded:.0%} of the token slots are padding")


if __name__ == "__main__":
    main()
