"""The images task without Ray: listing a folder, decoding, and the device-side augmentation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raylift.core.errors import SourceError
from raylift.data.sources import ERROR_COLUMN
from raylift.tasks.images import ImagesTask, class_names, decode, list_images
from tests.corpora import SHAPES, write_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("img") / "shapes", per_class=8, size=24)


def test_the_folder_is_listed_by_class(folder: Path) -> None:
    classes, found = list_images(str(folder))
    assert classes == sorted(SHAPES) == class_names(str(folder))
    assert len(found[""]) == 24 and all(p.endswith((".jpg", ".png")) for p in found[""])


def test_train_and_val_folders_are_used_as_they_are(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "train", per_class=3)
    write_image_folder(tmp_path / "val", per_class=1, seed=1)
    classes, found = list_images(str(tmp_path))
    assert classes == sorted(SHAPES) and class_names(str(tmp_path)) == classes
    assert len(found["train"]) == 9 and len(found["val"]) == 3


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "no class folders"),
        (lambda p: (p / "cats").mkdir(parents=True), "hold no"),
    ],
)
def test_a_bad_folder_is_named_with_the_fix(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "images"
    make(root)
    with pytest.raises(SourceError, match=message) as err:
        list_images(str(root))
    assert str(root) in str(err.value)


def test_decode_resizes_the_shorter_side_and_crops_square(folder: Path) -> None:
    from PIL import Image

    wide = folder.parent / "wide.png"
    Image.new("RGB", (60, 30), (255, 0, 0)).save(wide)
    img = decode(wide.read_bytes(), 16)
    assert img.shape == (3, 16, 16) and img.dtype == np.uint8 and img[0].min() == 255


def test_a_corrupt_file_becomes_an_error_row_naming_it(folder: Path) -> None:
    task = ImagesTask(root=str(folder), image_size=16)
    good = next((folder / "circle").glob("*.jpg"))
    bad = folder / "circle" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    try:
        out = task.preprocess(
            {"bytes": np.array([good.read_bytes(), bad.read_bytes()], dtype=object),
             "path": np.array([str(good), str(bad)])}
        )  # fmt: skip
    finally:
        bad.unlink()
    assert out["image"].shape == (2, 3, 16, 16) and out["label"].tolist() == [0, 0]
    assert out[ERROR_COLUMN][0] == "" and str(bad) in out[ERROR_COLUMN][1]


def test_augmentation_is_drawn_from_the_batch_generator_and_applied_on_the_device(
    folder: Path,
) -> None:
    task = ImagesTask(root=str(folder), image_size=16, pad=4)
    images = np.random.default_rng(0).integers(0, 256, (5, 3, 16, 16), dtype=np.uint8)
    cols = {"image": images, "label": np.zeros(5, dtype=np.int64)}
    a = task.transform(cols, np.random.default_rng([0, 1, 32]))
    b = task.transform(cols, np.random.default_rng([0, 1, 32]))
    assert np.array_equal(a["crop"], b["crop"]) and np.array_equal(a["flip"], b["flip"])
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in a.items()}
    out = task.finish(batch, torch.float32)["image"]
    plain = task.finish({"image": batch["image"], "label": batch["label"]}, torch.float32)["image"]
    assert out.shape == plain.shape == (5, 3, 16, 16)
    # The centre crop without a flip is the image itself; a flip mirrors it.
    centred = {**batch, "crop": torch.full((5, 2), 4), "flip": torch.tensor([0, 1, 0, 0, 0]).bool()}
    same = task.finish(centred, torch.float32)["image"]
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1].flip(-1))


def test_the_model_counts_its_flops_and_names_its_blocks(folder: Path) -> None:
    task = ImagesTask(root=str(folder), image_size=16, width=8)
    model = task.build_model()
    assert len(task.blocks(model)) == 6
    assert task.flops_per_sample(model) > 3 * 2 * sum(p.numel() for p in model.parameters())
    logits = model(torch.zeros(2, 3, 16, 16))
    assert logits.shape == (2, 3)


def test_bad_task_args_are_config_problems() -> None:
    from raylift.tasks import task_problems

    assert "task_args.root" in task_problems("images", {})[0]
    assert "val_percent" in task_problems("images", {"root": "x", "val_percent": 0})[0]


def test_prep_lists_the_folder_once_and_ships_no_listing_to_the_tasks(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards' version and the sources share one listing (a million-file bucket
    answers a thousand entries a request); preprocess then carries none of it."""
    import pickle

    import raylift.tasks.images as images

    calls = []
    real = images.listing
    monkeypatch.setattr(images, "listing", lambda root: calls.append(root) or real(root))
    task = ImagesTask(root=str(folder), image_size=16)
    version = task.data_version()
    sources = task.sources()
    assert len(calls) == 1 and version == ImagesTask(root=str(folder)).data_version()
    assert sum(len(s["path"]) for s in sources.values()) == 24
    assert len(pickle.dumps(task)) < 4096
