"""torch's DataLoader against mxload.torch.DataLoader on pipelines written the way torch users
write them: every sample a tensor (or a dict of tensors), collated by the loaders' defaults.

    python bench/torch_pipelines.py [--repeats N] [--epochs N] [--configs 0 2 2p] [--quick]
                                    [--workloads imagefolder timm hf hf-shuffled tensor]

Workloads (the data is generated locally, never downloaded):

* imagefolder: an ImageFolder-style dataset (class folders of generated JPEGs, decoded with
  PIL) with torchvision's training transforms RandomResizedCrop(128), RandomHorizontalFlip,
  ToTensor, Normalize, batch 32.  torchvision is not installed with this project's CPU torch
  (the registry's build is a CUDA one), so the transforms are written here, as torchvision
  2.x computes them, with PIL and torch (their random draws from torch's RNG, as torchvision's);
* timm: timm's eval transform on the same images: Resize(146, bicubic) of the shorter side,
  CenterCrop(128), ToTensor, Normalize, batch 32;
* hf: a Hugging Face ``datasets.Dataset`` of 20000 rows (64 float32 features, an int label)
  ``with_format("torch")``, batch 256 (skipped, with a message, without ``datasets``); unshuffled,
  as an evaluation loader: mxload fetches each batch's contiguous rows as one slice;
* hf-shuffled: the same, shuffle=True, as a training loader (each batch a gather of its rows);
* tensor: ``TensorDataset`` of 20000 x 64 float32 and int64 labels, batch 256.

Configurations: 0 workers, 2 workers, 2 persistent workers.  Each measurement is a fresh
Python process that builds the loader and runs `--epochs` epochs, timed from the first
``iter()`` to the end of the last epoch (worker starts included, as a training program pays
them); the figure is the time per epoch.  torch uses one intra-op thread in every process
(torch.set_num_threads(1): its workers' setting, here in the training process too).
Measurements alternate torch / mxload, in a rotating order, `--repeats` times; the table gives
the median per epoch, the spread (min-max), torch / mxload (> 1: mxload faster) and the
median of each repeat's own torch / mxload (its two runs back to back).  The
machine's load (uptime) is printed before and after.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import compile_mxload, header, median, table  # noqa: E402

WORKLOADS = ("imagefolder", "timm", "hf", "hf-shuffled", "tensor")
HF = ("hf", "hf-shuffled")
SHUFFLED = ("imagefolder", "hf-shuffled", "tensor")
CONFIGS = {"0": (0, False), "2": (2, False), "2p": (2, True)}
CONFIG_NAMES = {"0": "0 workers", "2": "2 workers", "2p": "2 persistent"}
SAMPLES = {"imagefolder": "tensors (3,128,128) float32 + int", "timm": "tensors (3,128,128) float32 + int",
           "hf": "dict of tensors (64,) float32 + ()", "hf-shuffled": "dict of tensors (64,) float32 + ()",
           "tensor": "tensors (64,) float32 + () int64"}
BATCH = {"imagefolder": 32, "timm": 32, "hf": 256, "hf-shuffled": 256, "tensor": 256}
IMAGES, IMAGE_SIZE, CLASSES = 512, (256, 192), 4
ROWS, FEATURES = 20000, 64
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ------------------------------------------------------------------ the data and the datasets


def make_images(root: str, seed: int = 0) -> None:
    """IMAGES JPEGs in CLASSES class folders: smooth random colour fields
    (decoding them costs what a photo of that size costs, unlike noise)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = IMAGE_SIZE
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(IMAGES):
        folder = os.path.join(root, f"class{i % CLASSES}")
        os.makedirs(folder, exist_ok=True)
        f = rng.uniform(0.01, 0.08, (3, 2))
        p = rng.uniform(0, 6.3, (3,))
        rgb = np.stack([127 + 120 * np.sin(f[c, 0] * xx + f[c, 1] * yy + p[c]) for c in range(3)], -1)
        Image.fromarray(rgb.astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


class ImageFolderLike:
    """torchvision.datasets.ImageFolder's behaviour: (class folder, file)
    pairs sorted, PIL decode to RGB, the transform, (image, class index)."""

    def __init__(self, root: str, transform: Any):
        self.classes = sorted(os.listdir(root))
        self.samples = [(os.path.join(root, c, f), k) for k, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        from PIL import Image
        path, target = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), target


def _to_tensor_normalized(img: Any) -> Any:
    """ToTensor() then Normalize(MEAN, STD), as torchvision computes them."""
    import numpy as np
    import torch
    t = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(img.size[1], img.size[0], 3)
    t = t.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)
    mean = torch.as_tensor(MEAN, dtype=t.dtype)
    std = torch.as_tensor(STD, dtype=t.dtype)
    return t.sub_(mean[:, None, None]).div_(std[:, None, None])


class TrainTransform:
    """RandomResizedCrop(size) (scale (0.08, 1), ratio (3/4, 4/3), bilinear),
    RandomHorizontalFlip(), ToTensor(), Normalize(): torchvision's draws."""

    def __init__(self, size: int = 128):
        self.size = size

    def __call__(self, img: Any) -> Any:
        import torch
        from PIL import Image
        width, height = img.size
        area = height * width
        log_ratio = (math.log(3 / 4), math.log(4 / 3))
        box = None
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(0.08, 1.0).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = int(torch.randint(0, height - h + 1, size=(1,)).item())
                j = int(torch.randint(0, width - w + 1, size=(1,)).item())
                box = (j, i, j + w, i + h)
                break
        if box is None:   # torchvision's fallback: the central crop
            w = h = min(width, height)
            box = ((width - w) // 2, (height - h) // 2, (width + w) // 2, (height + h) // 2)
        img = img.resize((self.size, self.size), Image.BILINEAR, box=box)
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor_normalized(img)


class EvalTransform:
    """timm's eval transform: Resize(size / crop_pct) of the shorter side
    (bicubic), CenterCrop(size), ToTensor(), Normalize()."""

    def __init__(self, size: int = 128, crop_pct: float = 0.875):
        self.size = size
        self.scale = int(math.floor(size / crop_pct))

    def __call__(self, img: Any) -> Any:
        from PIL import Image
        width, height = img.size
        if width <= height:
            new = (self.scale, int(self.scale * height / width))
        else:
            new = (int(self.scale * width / height), self.scale)
        img = img.resize(new, Image.BICUBIC)
        left = int(round((new[0] - self.size) / 2.0))
        top = int(round((new[1] - self.size) / 2.0))
        img = img.crop((left, top, left + self.size, top + self.size))
        return _to_tensor_normalized(img)


def build_dataset(workload: str, images: str) -> Any:
    import torch
    if workload in ("imagefolder", "timm"):
        # torchvision imports PIL when it is imported (its datasets and transforms modules): the
        # training process has it before any worker starts.  Imported only in __getitem__, every
        # worker of every epoch imported it afresh (~30-50 ms), for both loaders alike.
        import PIL.Image  # noqa: F401
    if workload == "imagefolder":
        return ImageFolderLike(images, TrainTransform())
    if workload == "timm":
        return ImageFolderLike(images, EvalTransform())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = torch.randint(0, 10, (ROWS,), generator=g)
    if workload == "tensor":
        return torch.utils.data.TensorDataset(x, y)
    import datasets
    return datasets.Dataset.from_dict({"x": x.numpy(), "label": y.numpy()}).with_format("torch")


# ------------------------------------------------------------------ one measurement (a fresh process)


def _cpu_s() -> float:
    """CPU seconds of this process and of its children it reaped."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(workload: str, impl: str, config: str, epochs: int, images: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its workers) per epoch:
    `epochs` epochs from the first iter(), in this process."""
    import torch
    if impl == "torch":
        from torch.utils.data import DataLoader
    else:
        from mxload.torch import DataLoader
    torch.manual_seed(0)
    # One intra-op thread in the training process too, as both loaders set it in their workers:
    # the transforms' small tensor ops spread over OpenMP threads made 0-worker image epochs
    # 5-10x slower and erratic on this shared 2-core machine, for both loaders alike.
    torch.set_num_threads(1)
    workers, persistent = CONFIGS[config]
    ds = build_dataset(workload, images)
    kwargs: dict[str, Any] = {"batch_size": BATCH[workload], "shuffle": workload in SHUFFLED}
    if workers:
        kwargs.update(num_workers=workers, persistent_workers=persistent)
    loader = DataLoader(ds, **kwargs)
    # A full collection of what the imports left (torch's: ~200k objects, 85-90 ms) comes when
    # the allocations since the last one reach a threshold: in a fresh process that point is
    # fixed by the script, not by the loader's work, and it fell inside one loader's few hundred
    # measured ms and not the other's (gc.callbacks).  Collected here, before either is timed.
    gc.collect()
    c0 = _cpu_s()
    t0 = time.perf_counter()
    seen = 0
    for _ in range(epochs):
        for batch in loader:
            first = batch[0] if isinstance(batch, (list, tuple)) else batch["x"]
            seen += int(first.shape[0])   # the batch reached the loop
    elapsed = time.perf_counter() - t0
    expected = epochs * len(ds)
    if seen != expected:
        raise SystemExit(f"{impl} {workload} {config}: {seen} samples, expected {expected}")
    del loader   # persistent workers end (and are reaped) here: their CPU time counts
    gc.collect()
    return elapsed / epochs, (_cpu_s() - c0) / epochs


def run_child(workload: str, impl: str, config: str, epochs: int, images: str) -> tuple[float, float]:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, impl, config,
                          str(epochs), images], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{impl} {workload} {config} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["s_per_epoch"]), float(got["cpu_s_per_epoch"])


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per loader and row (default 5)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per process (default 3)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--quick", action="store_true", help="3 repeats of 2 epochs")
    p.add_argument("--child", nargs=5, metavar=("WORKLOAD", "IMPL", "CONFIG", "EPOCHS", "IMAGES"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 3, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        workload, impl, config, epochs, images = args.child
        wall, cpu = measure(workload, impl, config, int(epochs), images)
        print(json.dumps({"s_per_epoch": wall, "cpu_s_per_epoch": cpu}))
        return 0
    try:
        import torch
    except ImportError as e:
        print(f"torch is not installed ({e}); this benchmark compares against it")
        return 0
    workloads = list(args.workloads)
    if set(HF) & set(workloads):
        try:
            import datasets
        except ImportError:
            print("skipping hf: the Hugging Face `datasets` package is not installed (pip install datasets)")
            workloads = [w for w in workloads if w not in HF]
        else:
            hf_version = datasets.__version__
    print(header("torch DataLoader vs mxload.torch.DataLoader, torch-style pipelines"))
    versions = f"# torch {torch.__version__}"
    if set(HF) & set(workloads):
        versions += f", datasets {hf_version}"
    print(versions + f"; {args.repeats} fresh processes per cell, {args.epochs} epochs each")
    # The measured processes import mxload from this checkout (run_child): its bytecode first.
    compile_mxload(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mxload"))
    print(f"# before: {uptime()}", flush=True)
    rows = [(w, c) for w in workloads for c in args.configs]
    times: dict[tuple[str, str, str], list[float]] = {(w, c, impl): [] for w, c in rows
                                                      for impl in ("torch", "mxload")}
    cpus: dict[tuple[str, str, str], list[float]] = {key: [] for key in times}
    with tempfile.TemporaryDirectory(prefix="mxload-bench-images-") as images:
        if {"imagefolder", "timm"} & set(workloads):
            make_images(images)
        for r in range(args.repeats):
            for k, (w, c) in enumerate(rows):
                order = ("torch", "mxload") if (r + k) % 2 == 0 else ("mxload", "torch")
                for impl in order:
                    wall, cpu = run_child(w, impl, c, args.epochs, images)
                    times[(w, c, impl)].append(wall)
                    cpus[(w, c, impl)].append(cpu)
            print(f"# repeat {r + 1}/{args.repeats} done, {uptime()}", flush=True)
    out = []
    for w, c in rows:
        t, m = times[(w, c, "torch")], times[(w, c, "mxload")]
        out.append((f"{w} ({BATCH[w]})", CONFIG_NAMES[c], f"{median(t):.3f} ({min(t):.3f}-{max(t):.3f})",
                    f"{median(m):.3f} ({min(m):.3f}-{max(m):.3f})", f"{median(t) / median(m):.2f}",
                    f"{min(a / b for a in t for b in m):.2f}-{max(a / b for a in t for b in m):.2f}",
                    f"{median([a / b for a, b in zip(t, m)]):.2f}",
                    f"{median(cpus[(w, c, 'torch')]) / median(cpus[(w, c, 'mxload')]):.2f}"))
    print()
    print(table(out, ["workload (batch)", "workers", "torch s/epoch (min-max)", "mxload s/epoch (min-max)",
                      "torch/mxload", "ratio range", "paired", "CPU torch/mxload"]))
    print("# ratio range: every torch run over every mxload run; paired: the median of each repeat's\n"
          "# torch / mxload, whose two runs are back to back (a slow drift of the machine's speed falls\n"
          "# on both); CPU: seconds of CPU per epoch, the training process and its workers together\n"
          "# (medians), less sensitive to other load")
    print()
    for w in workloads:
        print(f"# {w}: samples are {SAMPLES[w]}")
    print(f"# after: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
