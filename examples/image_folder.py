"""Train a small torch model on an image folder, with mxload loading it.

    python examples/image_folder.py --make-data            # a tiny generated folder, seconds
    python examples/image_folder.py --data path/to/folder  # class_name/*.jpg, like torchvision

The folder holds one sub-folder per class (``cat/0001.jpg``, ``dog/...``).
Workers decode each JPEG with PIL, take a random crop and a random horizontal
flip drawn from ``mxload.sample_rng()`` (so the augmentation is the same for
any number of workers and after resuming), and return uint8 (H, W, 3) images;
the training loop converts and normalises them with torch.

Needs torch and pillow: ``pip install "mxload[examples]"``.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import mxload

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class ImageFolder(mxload.Dataset):
    """(uint8 crop of `size` x `size` x 3, class index) per image file."""

    def __init__(self, root: str, size: int = 64):
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        if not self.classes:
            raise ValueError(f"{root} has no class folders (expected {root}/<class>/<image>.jpg)")
        self.files, self.labels = [], []
        for label, name in enumerate(self.classes):
            for file in sorted(os.listdir(os.path.join(root, name))):
                self.files.append(os.path.join(root, name, file))
                self.labels.append(label)
        self.size = size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = mxload.sample_rng()        # this sample's stream: (seed, epoch, index)
        with Image.open(self.files[i]) as im:
            im.draft("RGB", (self.size, self.size))   # JPEG: decode at a reduced scale when it can
            img = im.convert("RGB")
            if min(img.size) < self.size:
                img = img.resize((max(self.size, img.size[0]), max(self.size, img.size[1])))
            pixels = np.asarray(img)
        top = int(rng.integers(0, pixels.shape[0] - self.size + 1))
        left = int(rng.integers(0, pixels.shape[1] - self.size + 1))
        crop = pixels[top:top + self.size, left:left + self.size]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        return crop, self.labels[i]


def make_image_folder(root: str, classes: int = 3, per_class: int = 24, side: int = 80) -> str:
    """A tiny folder of JPEGs whose class is visible in the colour, so a small
    model can learn it in a few steps."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = os.path.join(root, f"class{c}")
        os.makedirs(folder, exist_ok=True)
        for k in range(per_class):
            pixels = rng.integers(0, 80, (side, side, 3), dtype=np.uint8)
            pixels[..., c % 3] += 160
            Image.fromarray(pixels).save(os.path.join(folder, f"{k:04d}.jpg"), quality=90)
    return root


class SmallNet(torch.nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train(root: str, epochs: int, batch_size: int, workers: int, size: int, device: str) -> float:
    dataset = ImageFolder(root, size)
    loader = mxload.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0, num_workers=workers,
                               last_batch="discard", persistent_workers=workers > 0)
    model = SmallNet(len(dataset.classes)).to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    accuracy = 0.0
    with loader:
        for epoch in range(epochs):
            t0, correct, seen = time.perf_counter(), 0, 0
            for images, labels in loader:
                # Zero-copy views of the batch's shared memory, then one copy to the device.
                x = torch.from_numpy(images).to(device, non_blocking=True)
                y = torch.from_numpy(labels).to(device, non_blocking=True)
                x = (x.permute(0, 3, 1, 2).float().div_(255) - MEAN.to(device)) / STD.to(device)
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
            accuracy = correct / max(seen, 1)
            print(f"epoch {epoch}: loss {loss.item():.3f}, train accuracy {accuracy:.0%}, "
                  f"{seen / (time.perf_counter() - t0):.0f} images/s")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="an image folder: one sub-folder of images per class")
    source.add_argument("--make-data", action="store_true", help="generate a tiny folder in a temp dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="crop side in pixels")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.make_data:
        with tempfile.TemporaryDirectory() as tmp:
            train(make_image_folder(tmp), args.epochs, args.batch_size, args.workers, args.size,
                  args.device)
    else:
        train(args.data, args.epochs, args.batch_size, args.workers, args.size, args.device)


if __name__ == "__main__":
    main()
