"""Image classification from a folder of images, with a small ResNet.

``task_args.root`` is a folder (local, or ``s3://`` / ``gs://``) with one subfolder
per class of JPEG or PNG files, the layout of torchvision's ``ImageFolder``. Where it
has ``train/`` and ``val/`` subfolders, each of those holds the class folders;
otherwise every image goes to val or train by a hash of its path.

``raylift prep`` reads and decodes the files in Ray Data tasks (``map_batches`` over the
listed paths, on every CPU of the cluster), each image once: it resizes the shorter side
to ``image_size``, centre-crops it square and stores it as uint8 CHW. An image that
cannot be decoded is skipped and counted; more than ``max_bad_fraction`` of them stops
prep, naming some. Training draws a random crop (after ``pad`` pixels of reflection
padding) and a horizontal flip per image: the offsets are drawn on the host from the
generator the loader seeds by the rows' place in the epoch (so a resumed run draws the
same ones), and applied on the device along with the uint8 -> float conversion and
normalisation.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.core.errors import SourceError
from raylift.core.storage import as_uri, filesystem
from raylift.data.sources import ERROR_COLUMN, Source, files_version, in_val, read_bytes
from raylift.tasks.base import Batch, Columns, ImageClassifier, not_hf

EXTENSIONS = (".jpg", ".jpeg", ".png")
# ImageNet's channel statistics: a fine default for natural images.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    """A stem and three stages of two basic blocks (widths w, 2w, 4w), as ResNet-20 on CIFAR."""

    def __init__(self, classes: int, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        widths = [width, 2 * width, 4 * width]
        blocks: list[nn.Module] = []
        cin = width
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def list_images(
    root: str, listed: list[Any] | None = None
) -> tuple[list[str], dict[str, list[str]]]:
    """(class names, {split: image paths}) under ``root``; SourceError for what is wrong.

    ``listed``: a recursive listing of ``root`` already made (``listing``), not made again.
    """
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type != pafs.FileType.Directory:
        what = "does not exist" if info.type == pafs.FileType.NotFound else "is not a folder"
        raise SourceError(f"task_args.root: {root} {what}; give a folder of class folders")
    if listed is None:
        listed = listing(root)
    top = {i.path[len(base) + 1 :].split("/", 1)[0] for i in listed}
    splits = ("train", "val") if {"train", "val"} <= top else ("",)
    found: dict[str, dict[str, list[str]]] = {}
    for split in splits:
        folder = f"{base}/{split}".rstrip("/")
        under = [i for i in listed if i.path.startswith(folder + "/")]
        found[split] = _class_files(under, folder, root)
    classes = sorted({c for per in found.values() for c in per})
    if not classes:
        raise SourceError(
            f"task_args.root: {root} has no class folders; put each class's images in "
            "root/<class>/ (or root/train/<class>/ and root/val/<class>/)"
        )
    return classes, {s: [p for files in per.values() for p in files] for s, per in found.items()}


def class_names(root: str) -> list[str]:
    """Sorted names of ``root``'s class folders (under ``train/`` where there is one)."""
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    top = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    names = {Path(i.path).name for i in top if i.type == pafs.FileType.Directory}
    if {"train", "val"} <= names:
        top = fs.get_file_info(pafs.FileSelector(f"{base}/train"))
        names = {Path(i.path).name for i in top if i.type == pafs.FileType.Directory}
    return sorted(names)


def listing(root: str) -> list[Any]:
    """Every file and folder under ``root``, recursively (pyarrow ``FileInfo``s): one
    listing, which an object store answers a thousand entries per request."""
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    return list(fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)))


def _class_files(listed: list[Any], folder: str, root: str) -> dict[str, list[str]]:
    import pyarrow.fs as pafs

    per: dict[str, list[str]] = {}
    for i in listed:
        if i.type == pafs.FileType.Directory and i.path.count("/") == folder.count("/") + 1:
            per.setdefault(Path(i.path).name, [])
    for i in listed:
        if i.type == pafs.FileType.File and i.path.lower().endswith(EXTENSIONS):
            cls = i.path[len(folder) + 1 :].split("/", 1)[0]
            if cls in per:
                per[cls].append(i.path)
    empty = sorted(c for c, files in per.items() if not files)
    if empty:
        raise SourceError(
            f"task_args.root: class folder(s) {empty} under {root} hold no "
            f"{'/'.join(EXTENSIONS)} images; remove them or add images"
        )
    return {c: sorted(files) for c, files in per.items()}


def decode(data: bytes, size: int) -> np.ndarray:
    """One image file -> uint8 CHW ``size`` x ``size``: shorter side resized, centre crop."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as raw:
        img = raw.convert("RGB")
        w, h = img.size
        scale = size / min(w, h)
        img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))))
        w, h = img.size
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
        return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1).copy()


class ImagesTask(ImageClassifier):
    """Classify the images of ``root``'s class folders at ``image_size`` pixels."""

    hf_config = not_hf  # its model is raylift's own: export writes safetensors

    def __init__(
        self,
        root: str = "",
        image_size: int = 64,
        width: int = 32,
        val_percent: int = 10,
        pad: int = 4,
        max_bad_fraction: float = 0.01,
    ):
        if not root:
            raise ValueError("task_args.root: the folder of class folders to train on")
        if not 0 < val_percent < 100:
            raise ValueError("task_args.val_percent: must be between 0 and 100")
        if not 0 <= max_bad_fraction < 1:
            raise ValueError("task_args.max_bad_fraction: must be in [0, 1)")
        self.root, self.image_size, self.width = root, image_size, width
        self.val_percent, self.pad, self.max_bad_fraction = val_percent, pad, max_bad_fraction
        self._classes: list[str] | None = None
        self._listed: list[Any] | None = None

    @property
    def classes(self) -> list[str]:
        """The class folders' names, sorted: one listing of a folder, not of the images."""
        if self._classes is None:
            self._classes = class_names(self.root)
        return self._classes

    def data_version(self) -> str:
        """The image files' paths, sizes and mtimes (one listing of ``root``): shards are
        prepared again after images are added, removed or replaced."""
        import pyarrow.fs as pafs

        return files_version([i for i in self._listing() if i.type == pafs.FileType.File])

    def _listing(self) -> list[Any]:
        """The root's listing, made once for the shards' version and the sources both."""
        if self._listed is None:
            self._listed = listing(self.root)
        return self._listed

    def build_model(self) -> nn.Module:
        return ResNet(len(self.classes), self.width)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # type: ignore[arg-type]

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one image: 3x its forward's, counted on the meta device."""
        from torch.utils.flop_counter import FlopCounterMode

        s = self.image_size
        with torch.device("meta"):
            shadow = ResNet(len(self.classes), self.width)
            with FlopCounterMode(display=False) as counter:
                shadow(torch.empty(1, 3, s, s))
        return 3.0 * counter.get_total_flops()

    # ------------------------------------------------------------ data

    def sources(self) -> dict[str, Source]:
        classes, found = list_images(self.root, self._listing())
        self._classes = classes
        self._listed = None  # not shipped to the tasks with ``preprocess``
        if "" in found:  # one folder: split by a hash of the path under the root
            paths = found.pop("")
            base = filesystem(self.root)[1]
            rel = {p: p[len(base) :].lstrip("/").encode() for p in paths}
            val = [p for p in paths if in_val(rel[p], self.val_percent)]
            held = set(val)
            found = {"train": [p for p in paths if p not in held], "val": val}
        if not found["train"] or not found["val"]:
            raise SourceError(
                f"task_args.root: {self.root} has too few images for a train/val split"
            )
        # The paths, not a Ray Data reader: ``preprocess`` reads each file where it runs.
        # A reader pays ~0.3 ms of bookkeeping per small file, about as much as the
        # decode; and the listing is in memory anyway, so prep shuffles it there.
        return {
            split: {"path": np.array([as_uri(like=self.root, path=p) for p in paths])}
            for split, paths in found.items()
        }

    def preprocess(self, batch: Columns) -> Columns:
        """Decode and resize; an undecodable file becomes an error row that prep drops."""
        index = {c: i for i, c in enumerate(self.classes)}
        images, labels, errors = [], [], []
        s = self.image_size
        for path in batch["path"]:
            try:
                images.append(decode(read_bytes(str(path)), s))
                errors.append("")
            except Exception as exc:  # PIL raises many kinds for corrupt files
                images.append(np.zeros((3, s, s), dtype=np.uint8))
                errors.append(f"{path}: {type(exc).__name__}: {exc}")
            labels.append(index[Path(str(path)).parent.name])
        return {
            "image": np.stack(images) if images else np.zeros((0, 3, s, s), dtype=np.uint8),
            "label": np.asarray(labels, dtype=np.int64),
            # A numpy str column: an object one costs Ray ~20x more to turn into Arrow.
            ERROR_COLUMN: np.asarray(errors, dtype=str),
        }

    def transform(self, batch: Columns, rng: np.random.Generator) -> Columns:
        """Per training batch, on the host: only the crop offsets and flips are drawn."""
        n = len(batch["label"])
        extra = {
            "crop": rng.integers(0, 2 * self.pad + 1, size=(n, 2), dtype=np.int64),
            "flip": rng.random(n) < 0.5,
        }
        return {**batch, **extra}

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        x = batch["image"]
        mean = torch.tensor(MEAN, device=x.device, dtype=dtype).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device, dtype=dtype).view(1, 3, 1, 1)
        x = (x.to(dtype).div_(255.0) - mean) / std
        if "crop" in batch:  # a training batch: augment on the device
            x = self._augment(x, batch["crop"], batch["flip"])
        return {"image": x, "label": batch["label"].long()}

    def _augment(self, x: torch.Tensor, crop: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        """Random crop of the reflection-padded image, then a horizontal flip, batched."""
        b, _, s, _ = x.shape
        padded = F.pad(x, (self.pad,) * 4, mode="reflect")
        ar = torch.arange(s, device=x.device)
        rows = (crop[:, 0:1] + ar)[:, :, None]  # (b, s, 1)
        cols = (crop[:, 1:2] + ar)[:, None, :]  # (b, 1, s)
        idx = torch.arange(b, device=x.device)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[idx, rows, cols].permute(0, 3, 1, 2)  # (b, c, s, s)
        return torch.where(flip.view(b, 1, 1, 1), out.flip(-1), out).contiguous()
