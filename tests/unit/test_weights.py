"""model.weights: safetensors checked by the driver from headers, loaded one tensor at a
time into every strategy's shards (rank 0 reading and broadcasting, or, from a store,
each rank reading its own shard's bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raylift.core.parsing import merge
from raylift.tasks import build_task
from raylift.tensors.weights import WeightsError, check, load
from tests.helpers import GPT_SMALL, HANG_S, make_config, run_ranks
from tests.unit.test_init import STRATEGIES, initial_params

REPO = Path(__file__).resolve().parents[2]


def pretrained(tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A gpt's weights as safetensors (tied head saved once), values unlike any init."""
    from safetensors.torch import save_model

    model = build_task("gpt", GPT_SMALL["task_args"]).build_model()
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    path = tmp / "model.safetensors"
    save_model(model, str(path))
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def shell() -> torch.nn.Module:
    with torch.device("meta"):
        return build_task("gpt", GPT_SMALL["task_args"]).build_model()


def rewrite(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    for k, v in edit.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, str(dst))
    return dst


def test_bad_weights_name_the_tensor_and_the_file(tmp_path: Path) -> None:
    good, _ = pretrained(tmp_path)
    check(shell(), str(good))  # the tied head saved once is fine
    cases = {
        "missing": ({"blocks.0.qkv.weight": None}, r"blocks\.0\.qkv\.weight .*missing from"),
        "extra": ({"lm_extra.weight": torch.zeros(2)}, r"lm_extra\.weight in .*extra\.safetensors"),
        "shape": (
            {"ln_f.weight": torch.zeros(3)},
            r"ln_f\.weight in .*shape\.safetensors has shape \[3\]",
        ),
    }
    for name, (edit, message) in cases.items():
        bad = rewrite(good, tmp_path / f"{name}.safetensors", edit)
        with pytest.raises(WeightsError, match=message):
            check(shell(), str(bad))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"cannot read .*cut\.safetensors"):
        check(shell(), str(cut))
    with pytest.raises(WeightsError, match=r"neither a \.safetensors file"):
        check(shell(), str(tmp_path / "nowhere"))


def test_a_sharded_folder_with_its_index_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from raylift.tensors.init import write_in_place

    good, values = pretrained(tmp_path)
    tensors = load_file(str(good))
    names = sorted(tensors)
    folder = tmp_path / "hf"
    folder.mkdir()
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = build_task("gpt", GPT_SMALL["task_args"]).build_model()
    load(model, str(folder), write_in_place)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, values[k], rtol=0, atol=0, msg=k)
    assert model.head.weight is model.tok.weight


@pytest.mark.slow
def test_every_strategy_starts_from_the_weights(tmp_path: Path) -> None:
    path, values = pretrained(tmp_path)
    runs = {
        name: make_config(
            **merge(GPT_SMALL, {"strategy": s, "model": {"weights": str(path)}})
        ).to_dict()
        for name, s in STRATEGIES.items()
    }
    run_ranks(2, tmp_path, initial_params, runs, str(tmp_path / "init.pt"))
    found = torch.load(tmp_path / "init.pt", weights_only=True)
    for name in STRATEGIES:
        got = found[name]["params"]
        for k in values:
            torch.testing.assert_close(got[k], values[k], rtol=0, atol=0, msg=f"{name} {k}")


class Bf16Net(torch.nn.Module):
    """bf16 weights and an int64 buffer beyond float32's exact integers."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64, 33, dtype=torch.bfloat16))
        self.register_buffer("ids", torch.zeros(3, dtype=torch.int64))


def bf16_file(tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every bit pattern a bf16 can hold at random (NaN payloads, -0, subnormals, inf)."""
    from safetensors.torch import save_file

    bits = torch.randint(-(2**15), 2**15, (64, 33), generator=torch.Generator().manual_seed(5))
    tensors = {
        "weight": bits.to(torch.int16).view(torch.bfloat16),
        "ids": torch.tensor([2**53 + 1, -(2**40) - 3, 7]),
    }
    save_file(tensors, str(tmp / "bf16.safetensors"))
    return tmp / "bf16.safetensors", tensors


def received(rank: int, world: int, path: str, out: str) -> None:
    """What ``load`` hands each rank's writer, and the buffer it fills, as they arrive."""
    model = Bf16Net()
    got: dict[str, torch.Tensor] = {}

    def write(p: torch.nn.Parameter, value: torch.Tensor) -> None:
        got["weight"] = value.clone()

    load(model, path, write)
    got["ids"] = model.ids.clone()
    torch.save(got, f"{out}.{rank}")


def test_bf16_weights_reach_every_rank_bit_for_bit_in_bf16(tmp_path: Path) -> None:
    path, saved = bf16_file(tmp_path)
    run_ranks(2, tmp_path, received, str(path), str(tmp_path / "got"))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"got.{rank}", weights_only=True)
        assert got["weight"].dtype == torch.bfloat16, (rank, got["weight"].dtype)
        assert torch.equal(got["weight"].view(torch.int16), saved["weight"].view(torch.int16))
        assert torch.equal(got["ids"], saved["ids"]), (rank, got["ids"])


def test_train_refuses_bad_weights_before_anything_starts(tmp_path: Path) -> None:
    good, _ = pretrained(tmp_path)
    bad = rewrite(good, tmp_path / "bad.safetensors", {"ln_f.weight": torch.zeros(3)})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raylift.cli",
            "train",
            str(REPO / "configs" / "gpt-tiny.yaml"),
            "task_args.n_layer=2",
            "task_args.d_model=64",
            "task_args.block_size=32",
            f"model.weights={bad}",
            f"storage={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ln_f.weight" in proc.stderr and "bad.safetensors" in proc.stderr
    assert "Ray" not in proc.stdout  # refused before Ray or MLflow started


def test_the_drivers_check_of_weights_in_an_object_store_reads_their_headers_only(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted by a proxy in front of the S3 server: a few KiB for 4 MiB of weights, and a
    wrong shape is still named."""
    from safetensors.torch import save_file

    from raylift.core import storage
    from tests.helpers import CountingProxy

    weights = {"weight": torch.zeros(1024, 1024), "bias": torch.zeros(1024)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    uri = f"s3://data/{tmp_path.name}/model.safetensors"
    storage.write_bytes(uri, (tmp_path / "model.safetensors").read_bytes())
    proxy = CountingProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with torch.device("meta"):
            assert set(check(torch.nn.Linear(1024, 1024), uri)) == {"weight", "bias"}
            with pytest.raises(WeightsError, match=r"tensor weight in .* has shape \[1024, 1024\]"):
                check(torch.nn.Linear(1024, 512), uri)
    finally:
        proxy.close()
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size > 4 << 20 and 0 < proxy.served < 64 << 10, (proxy.served, size)


# A gpt of 6 MiB whose every dimension is odd: FSDP2's rows split unevenly and every
# ZeRO-3 partition ends in padding.
ODD_GPT = {"block_size": 33, "n_layer": 2, "n_head": 5, "d_model": 255, "max_bytes": 50_000}
SHARDED = {"fsdp": STRATEGIES["fsdp"], "zero3": STRATEGIES["zero3"]}


def load_from_store(rank: int, world: int, runs: dict[str, tuple[dict, list]], out: str) -> None:
    """In a pool rank: each run's trainer (its config, and per rank the environment that
    rank reads the store with: its own proxy or token, so that the server tells the ranks'
    reads apart), and the whole parameters it starts from."""
    import os

    from raylift.validation import config_from_dict
    from tests.helpers import LocalReporter, make_trainer
    from tests.unit.test_init import whole_params

    found = {}
    for name, (cfg_dict, envs) in runs.items():
        before = {k: os.environ.get(k) for k in envs[rank]}
        os.environ.update(envs[rank])
        try:
            cfg = config_from_dict(cfg_dict)
            trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent / name))
            found[name] = whole_params(trainer.engine)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    if rank == 0:
        torch.save(found, out)


def odd_gpt_weights(folder: Path) -> dict[str, torch.Tensor]:
    """``ODD_GPT``'s weights in ``folder/model.safetensors`` (tied head saved once), drawn
    unlike any init; the file's tensors."""
    from safetensors.torch import load_file, save_model

    model = build_task("gpt", ODD_GPT).build_model()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    folder.mkdir()
    save_model(model, str(folder / "model.safetensors"))
    return load_file(str(folder / "model.safetensors"))


def test_each_rank_reads_only_its_own_share_of_weights_in_a_store(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights on the Hub (``hf://org/name@<commit>``, as the driver pins them) under FSDP2
    and ZeRO-3, and in S3 under FSDP2, loaded on 2 ranks: every parameter is the file's
    tensor bit for bit, and each rank's reads, counted where they are served (the Hub's by
    each rank's token, S3's by a proxy in front of it for each rank), come to its half of
    the tensors' bytes, rank 0's with the header: no rank reads the file whole, and no
    read fetches more than it asked for."""
    from raylift.core import storage
    from tests.helpers import CountingProxy
    from tests.hub_server import HubServer

    values = odd_gpt_weights(tmp_path / "weights")
    file = tmp_path / "weights" / "model.safetensors"
    size = file.stat().st_size
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    data = size - header  # the tensors' bytes
    uri = f"s3://data/{tmp_path.name}/model.safetensors"
    storage.write_bytes(uri, file.read_bytes())
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1"}  # fmt: skip
    proxies = [CountingProxy(s3_server) for _ in range(2)]
    hub = HubServer(tmp_path / "hub")
    hub.tokens = {f"hf_{name}_{rank}" for name in SHARDED for rank in range(2)}
    served: dict[str, list[int]] = {}
    try:
        with hub:
            hub.use(monkeypatch, tmp_path / "hf-home")
            pinned = f"hf://org/odd-gpt@{hub.add_repo('org/odd-gpt', tmp_path / 'weights')}"

            def run(strategy: dict, weights: str, envs: list[dict]) -> tuple[dict, list]:
                cfg = make_config(
                    task="gpt", task_args=ODD_GPT, strategy=strategy, model={"weights": weights}
                )
                return cfg.to_dict(), envs

            def tokens(name: str) -> list[dict]:
                return [{"HF_ENDPOINT": hub.url, "HF_TOKEN": f"hf_{name}_{r}"} for r in range(2)]

            runs = {f"hub-{n}": run(s, pinned, tokens(n)) for n, s in SHARDED.items()}
            runs["s3-fsdp"] = run(
                SHARDED["fsdp"], uri, [{**aws, "AWS_ENDPOINT_URL": p.endpoint} for p in proxies]
            )
            run_ranks(2, tmp_path, load_from_store, runs, str(tmp_path / "loaded.pt"))
            for name in SHARDED:
                served[f"hub-{name}"] = [
                    sum(r.sent for r in hub.requests
                        if r.token == f"hf_{name}_{rank}" and r.file == "model.safetensors")
                    for rank in range(2)
                ]  # fmt: skip
        assert not hub.errors, hub.errors[0]
    finally:
        for proxy in proxies:
            proxy.close()
    served["s3-fsdp"] = [proxy.served for proxy in proxies]
    found = torch.load(tmp_path / "loaded.pt", weights_only=True)
    for name, params in found.items():
        for tensor, value in values.items():
            assert torch.equal(params[tensor], value), (name, tensor)
    print(f"\nweights file: {size} bytes, {header} of them its header, {data} its tensors'")
    for name, (first, second) in served.items():
        print(f"{name}: rank 0 read {first} bytes of it, rank 1 {second}")
        # A row of a few tensors falls to one rank (odd dims), and S3's answers count
        # their HTTP headers: a little either way of half.
        slack = 0.02 * data
        assert abs(first - header - data / 2) < slack, (name, first, data)
        assert abs(second - data / 2) < slack, (name, second, data)
        if name.startswith("hub"):  # bodies alone: every byte read once, the header at most
            assert first + second in (data, size), (name, first, second)  # (kept at a commit)
