"""What raylift uses of DeepSpeed, torch, transformers and MLflow that they do not
promise, one test each (Ray's: tests/unit/test_ray_private.py).

pyproject.toml bounds each of them to the newest minor these tests ran against
(deepspeed 0.19, transformers 5.24, torch 2.13). Where a public API does the job raylift
uses it; what is left is below, each test naming the raylift code that depends on it, so
an upgrade that changes one says what to mend:

- ``strategies.zero_layout``: a resharded resume runs DeepSpeed's universal load with its
  per-weight read replaced. ZeRO-1/2: each weight's ``_hp_mapping`` (its
  ``lp_fragment_address``, ``get_hp_fragment()``, ``optim_fragment``) and the
  ``load_hp_checkpoint_state`` that ``enable_universal_checkpoint`` gives each weight;
  ZeRO-3: the optimizer's ``load_hp_checkpoint_state(folder, key, param=)`` and
  ``_get_param_partition_group``; both: the partition files' keys. DeepSpeed's public
  ``safe_set_*`` setters cannot do this load (the module's docstring says why);
- ``strategies.deepspeed``: ``_link_all_hp_params`` (``share_fp32_master``), the CPU
  accelerator's ``_communication_backend_name`` and ``deepspeed.ops.__compatible_ops__``
  (``use_the_run_process_group``), the engine's ``_config`` (its checkpoint engine, and
  ``load_universal_checkpoint`` switched for one load), the optimizers' gradient and
  master attributes it counts (``_GRAD_ATTRS``, ``_MASTER_ATTRS``), ``import torch._dynamo``
  before ``zero.Init`` (``create``);
- ``tensors.init.write_dtensor``: torch's ``compute_local_shape_and_global_offset``: the
  public ``distribute_tensor(..., src_data_rank=None)`` keeps the same slice but first
  moves the whole tensor to the mesh's device (every rank's GPU would hold each weight
  whole) and copies the shard again (2.5-5x slower on the CPU here);
- ``run.plan.saved_activation_bytes``: a storage's ``_cdata``, which tells storages
  apart on the meta device, where every ``data_ptr()`` is 0;
- ``run.loop.compile_criterion``: ``_torchdynamo_orig_callable``, the mark of a callable
  torch.compile made;
- ``tensors.lazytorch``: torch.save's pickle names (``torch._utils._rebuild_tensor_v2``,
  ``_rebuild_parameter``, ``torch._tensor._rebuild_from_type_v2``) and a typed storage's
  ``_dtype``;
- ``tensors.init.init_function``: a transformers model's ``_init_weights(module)``, the
  per-module init transformers itself dispatches to (its public ``init_weights`` draws the
  whole model at once); ``tasks.hf.blocks``: its ``_no_split_modules``;
- ``tensors.hf_layout`` and ``tasks.hf``: transformers' loading rules, public names in
  modules it does not document (``core_model_loading``, ``conversion_mapping``,
  ``initialization.no_init_weights``, ``models.auto.modeling_auto``);
- ``run.wire``: torch's Flight Recorder as JSON (``torch._C._distributed_c10d.
  _dump_fr_trace_json``; its documented dump is a pickle, which raylift never loads) and
  the group a recorded name stands for (``distributed_c10d._resolve_process_group``):
  the only record of which group a collective ran on;
- ``artifacts.tracking.process_uri`` (``mlmodel.download``, ``tracking_service``):
  MLflow's process-wide URIs, which MLflow 3.17 resolves ``models:/`` and ``runs:/``
  through even where it takes ``tracking_uri``/``registry_uri`` arguments.

Not pinned here: ``tensors.ranged`` (a DCP ``FileSystemReader`` subclass that sets its
``fs`` and ``path`` and reads its ``storage_data``) and ``tensors.streaming`` (DCP's
``.metadata`` and ``storage_data`` read directly), whose tests read real checkpoints with
them; ``core.storage`` reaches no private name.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import re
import tokenize
import zipfile
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import raylift
from tests.helpers import run_ranks


def needs(thing: object, what: str, user: str) -> None:
    assert thing is not None, f"no {what} any more: mend raylift's {user}"


def source_has(obj: Any, text: str, user: str) -> None:
    """``obj``'s source says ``text`` (spaces and line breaks aside)."""
    bare = re.sub(r"\s+", "", inspect.getsource(obj))
    assert re.sub(r"\s+", "", text) in bare, (
        f"{obj.__module__}.{obj.__qualname__} no longer does {text!r}: mend raylift's {user}"
    )


def params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# ---------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def deepspeed() -> Any:
    from raylift.strategies.deepspeed import import_deepspeed

    return import_deepspeed("cuda" if torch.cuda.is_available() else "cpu")


def test_zero12_universal_load_reads_each_weight_through_its_own_loader(deepspeed: Any) -> None:
    from deepspeed.checkpoint import universal_checkpoint
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.tensor_fragment import fragment_address, tensor_fragment

    user = "zero_layout.share and zero_layout.fed (ZeRO-1/2)"
    load = ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir
    for text in ('os.path.join(checkpoint_dir, "zero")', "optimizer_state.pt",
                 "lp._hp_mapping is not None", "step = lp.load_hp_checkpoint_state(",
                 "self.param_names[lp]", "map_to_flat_opt_states("):  # fmt: skip
        source_has(load, text, user)
    source_has(DeepSpeedZeroOptimizer._load_universal_checkpoint, '"bit16_groups"', user)
    source_has(DeepSpeedZeroOptimizer.__init__, "self.bit16_groups", user)
    source_has(
        universal_checkpoint.enable_universal_checkpoint,
        "param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)",
        user,
    )
    # What zero_layout._fragment_loader does in its place, as DeepSpeed's own does it.
    own = universal_checkpoint.load_hp_checkpoint_state
    assert params(own)[:4] == ["self", "folder", "tp_rank", "tp_world_size"], f"mend {user}"
    for text in ("hp_mapping = self._hp_mapping", "hp_mapping.optim_fragment = {}",
                 "hp_mapping.get_hp_fragment()", "hp_mapping.optim_fragment[key] =",
                 "lp_frag_address = hp_mapping.lp_fragment_address", "return step"):  # fmt: skip
        source_has(own, text, user)
    fields = {f.name for f in dataclasses.fields(tensor_fragment)}
    assert {"lp_fragment_address", "optim_fragment"} <= fields, f"mend {user}"
    assert {f.name for f in dataclasses.fields(fragment_address)} == {"start", "numel"}
    needs(
        getattr(tensor_fragment, "get_hp_fragment", None), "tensor_fragment.get_hp_fragment", user
    )


def test_zero3_universal_load_asks_the_optimizer_for_each_weights_partition(
    deepspeed: Any,
) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    user = "zero_layout.share and zero_layout.fed (ZeRO-3)"
    assert params(Stage3.load_hp_checkpoint_state) == ["self", "folder", "key", "param"]
    load = Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    for text in ('os.path.join(checkpoint_dir, "zero")', "optimizer_state.pt",
                 '["fp32", "exp_avg", "exp_avg_sq"]', "for param in fp16_group:",
                 "self.load_hp_checkpoint_state(os.path.join(checkpoint_dir, param_name), "
                 "key, param=param)", "[OPTIMIZER_STATE_DICT]['state'][0]['step']"):  # fmt: skip
        source_has(load, text, user)
    # raylift's share of a weight is the one DeepSpeed's own loader takes: the same group.
    source_has(Stage3.load_hp_checkpoint_state, "self._get_param_partition_group(param)", user)
    source_has(Stage3._get_param_partition_group, "ds_process_group", user)
    source_has(Stage3.__init__, "self.fp16_groups", user)


def test_zero_partition_files_keep_the_keys_raylift_reads(deepspeed: Any) -> None:
    from deepspeed.checkpoint import constants

    user = "zero_layout.locate / saved_step / settings and zero_files"
    keys = {
        "ZERO_STAGE": "zero_stage", "PARAM_SHAPES": "param_shapes",
        "PARAM_ALIGNMENT_PADDINGS": "param_alignment_paddings",
        "SINGLE_PARTITION_OF_FP32_GROUPS": "single_partition_of_fp32_groups",
        "BASE_OPTIMIZER_STATE": "base_optimizer_state", "FP32_FLAT_GROUPS": "fp32_flat_groups",
        "OPTIMIZER_STATE_DICT": "optimizer_state_dict",
        "PARAM_SLICE_MAPPINGS": "param_slice_mappings",
    }  # fmt: skip
    for name, value in keys.items():
        assert getattr(constants, name, None) == value, f"DeepSpeed's {name} changed: mend {user}"


def test_the_deepspeed_engine_internals_raylift_reaches(deepspeed: Any) -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from raylift.strategies import deepspeed as ours

    share = "deepspeed.share_fp32_master"
    needs(
        getattr(DeepSpeedZeroOptimizer, "_link_all_hp_params", None), "_link_all_hp_params", share
    )
    for text in ("self.single_partition_of_fp32_groups", "self.real_dp_process_group",
                 "self.parallel_partitioned_bit16_groups"):  # fmt: skip
        source_has(DeepSpeedZeroOptimizer.__init__, text, share)
    source_has(Stage3, "self.fp32_partitioned_groups_flat", share)
    source_has(Stage3, "self.fp16_partitioned_groups_flat", share)

    group = "deepspeed.use_the_run_process_group"
    source_has(CPU_Accelerator.__init__, "self._communication_backend_name = ", group)
    source_has(
        CPU_Accelerator.communication_backend_name, "self._communication_backend_name", group
    )
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is torch
    source_has(ds_comm.build_shm_op, "deepspeed.ops.__compatible_ops__.get(builder.NAME", group)
    source_has(deepspeed.ops, '"__compatible_ops__"', group)  # read lazily: probing compiles
    assert ShareMemCommBuilder.NAME == "deepspeed_shm_comm", f"mend raylift's {group}"

    engine = "DeepSpeedEngine (its part_files and _load)"
    source_has(DeepSpeedEngine.__init__, "self._config = ", engine)
    source_has(
        DeepSpeedEngine.load_universal_checkpoint, "self._config.load_universal_checkpoint", engine
    )
    source_has(TorchCheckpointEngine.__init__, "config_params.checkpoint_config", engine)

    # The byte counts' names, each an attribute one of DeepSpeed's optimizers sets.
    sources = "".join(
        inspect.getsource(inspect.getmodule(c))  # type: ignore[arg-type]
        for c in (DeepSpeedZeroOptimizer, Stage3)
    )
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.fp16 import fused_optimizer, unfused_optimizer

    for module in (bf16_optimizer, fused_optimizer, unfused_optimizer):
        sources += inspect.getsource(module)
    for name in ours._GRAD_ATTRS + ours._GRAD_ATTRS_STAGE3 + ours._MASTER_ATTRS:
        found = re.search(rf"self\.{name}\s*=[^=]", sources)
        assert found, f"DeepSpeed no longer keeps {name}: mend {engine}._held_grad_bytes"
    needs(importlib.import_module("torch._dynamo"), "torch._dynamo", "deepspeed.create")


# ---------------------------------------------------------------- torch


def slices_as_distribute_tensor(rank: int, world: int) -> None:
    """write_dtensor keeps the slice torch's public distribute_tensor would keep."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from raylift.tensors.init import write_dtensor

    meshes = {1: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", (1, world))}
    cases = [(1, [Shard(0)], (5, 3)), (1, [Shard(1)], (4, 7)), (2, [Replicate(), Shard(0)], (9, 2))]
    for dims, placements, shape in cases:
        mesh = meshes[dims]
        value = torch.arange(prod(shape), dtype=torch.float32).reshape(shape)
        param = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
        write_dtensor(param, value)
        public = distribute_tensor(value, mesh, placements, src_data_rank=None)
        assert torch.equal(param.to_local(), public.to_local()), (
            "torch's compute_local_shape_and_global_offset no longer gives the slice "
            f"distribute_tensor keeps ({placements}, {shape}): mend tensors.init.write_dtensor"
        )


def test_hpz_group_is_a_module_global_made_once(deepspeed: Any) -> None:
    """DeepSpeed keeps hpZ's node group in ``groups._ZERO_PARAM_INTRA_PARALLEL_GROUP`` and
    refuses to make a second while it is set: raylift's forget_hpz_group resets it
    before each ZeRO-3 build, so a second run in one process makes its own."""
    import inspect

    from deepspeed.utils import groups

    assert hasattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP")
    made = inspect.getsource(groups._create_zero_param_parallel_group)
    assert "_ZERO_PARAM_INTRA_PARALLEL_GROUP is None" in made


def test_a_dtensors_shard_is_where_torchs_own_helper_says(tmp_path: Path) -> None:
    from torch.distributed.tensor import _utils

    user = "tensors.init.write_dtensor"
    find = getattr(_utils, "compute_local_shape_and_global_offset", None)
    needs(find, "torch.distributed.tensor._utils.compute_local_shape_and_global_offset", user)
    assert params(find)[:3] == ["global_shape", "mesh", "placements"], f"mend {user}"
    run_ranks(2, tmp_path, slices_as_distribute_tensor)


def recorded_collectives(rank: int, world: int, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = dist.new_group([0, 1])
    dist.all_gather_into_tensor(torch.empty(6), torch.ones(3), group=group)
    entry = json.loads(c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    last = entry["entries"][-1]
    if rank == 0:
        name = last["process_group"][0]
        ranks = dist.get_process_group_ranks(_resolve_process_group(name))
        torch.save({"last": last, "ranks": ranks, "name": group.group_name}, out)


def test_the_flight_recorder_names_each_collective_and_its_group(tmp_path: Path) -> None:
    """run.wire reads, of each entry, the operation, the group's name (resolved to its
    ranks), the tensors' sizes and dtypes and when it was issued."""
    run_ranks(2, tmp_path, recorded_collectives, str(tmp_path / "fr.pt"))
    got = torch.load(tmp_path / "fr.pt", weights_only=True)
    last, user = got["last"], "run.wire"
    assert last["profiling_name"] == "gloo:all_gather", f"mend {user}.KINDS: {last}"
    assert last["process_group"][0] == got["name"] and got["ranks"] == [0, 1], f"mend {user}"
    assert last["input_sizes"] == [[3]] and last["output_sizes"] == [[2, 3]], f"mend {user}"
    assert last["input_dtypes"] == ["Float"] and isinstance(last["time_created_ns"], int)


def test_torch_internals_raylift_reads() -> None:
    # run.plan: one storage, one _cdata, for every view of it, also on the meta device.
    t = torch.empty(4, 4, device="meta")
    other = torch.empty(4, 4, device="meta")
    assert t.untyped_storage()._cdata == t[1:].untyped_storage()._cdata, "mend run.plan"
    assert t.untyped_storage()._cdata != other.untyped_storage()._cdata, "mend run.plan"

    def criterion(x: torch.Tensor) -> torch.Tensor:
        return x

    compiled = torch.compile(criterion, backend="eager")  # nothing is traced until called
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is criterion, (
        "torch.compile no longer marks what it made: mend run.loop.compile_criterion"
    )


def test_torch_save_pickles_tensors_as_lazytorch_unpickles_them() -> None:
    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "p": nn.Parameter(torch.ones(2))}, buf)
    with zipfile.ZipFile(buf) as zf:
        pickled = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    for name in (b"torch._utils\n_rebuild_tensor_v2", b"torch._utils\n_rebuild_parameter"):
        assert name in pickled, f"torch.save no longer pickles {name!r}: mend tensors.lazytorch"
    needs(
        getattr(torch._tensor, "_rebuild_from_type_v2", None), "_rebuild_from_type_v2", "lazytorch"
    )
    assert torch.FloatStorage._dtype == torch.float32, "mend tensors.lazytorch (storage _dtype)"


# ---------------------------------------------------------------- transformers


def test_transformers_initialises_a_module_through_its_models_init_weights() -> None:
    from transformers import LlamaPreTrainedModel, PreTrainedModel

    user = "tensors.init.init_function"
    assert params(PreTrainedModel._init_weights) == ["self", "module"], f"mend {user}"
    source_has(PreTrainedModel._initialize_weights, "self._init_weights(module)", user)
    assert hasattr(PreTrainedModel, "_no_split_modules"), "mend raylift's tasks.hf.blocks"
    assert "LlamaDecoderLayer" in (LlamaPreTrainedModel._no_split_modules or ()), (
        "transformers' models no longer name their blocks in _no_split_modules: mend "
        "raylift's tasks.hf.blocks"
    )


def test_transformers_loading_rules_as_hf_layout_applies_them() -> None:
    from transformers import conversion_mapping, core_model_loading, initialization
    from transformers.models.auto import modeling_auto

    user = "tensors.hf_layout"
    rename = core_model_loading.rename_source_key
    assert params(rename)[:3] == ["source_key", "weight_renamings", "weight_converters"]
    assert rename("a.b", [], []) == ("a.b", None), f"mend {user}.Layout.model_name"
    assert params(core_model_loading.revert_weight_conversion) == ["model", "state_dict"]
    assert params(conversion_mapping.get_model_conversion_mapping)[0] == "model", f"mend {user}"
    converter = core_model_loading.WeightConverter
    assert params(converter.add_tensor)[1:5] == [
        "target_key", "source_key", "source_pattern", "future"
    ], f"mend {user}.Layout.join"  # fmt: skip
    assert params(converter.convert)[1:4] == ["layer_name", "model", "config"], f"mend {user}"
    source_has(converter.__mro__[1].__init__, "self.source_patterns", user)
    assert issubclass(core_model_loading.WeightRenaming, converter.__mro__[1]), f"mend {user}"
    assert core_model_loading.dot_natural_key("a.10") > core_model_loading.dot_natural_key("a.9")
    needs(getattr(initialization, "no_init_weights", None), "no_init_weights", "tasks.hf")
    needs(getattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING", None), "the mapping", "tasks.hf")


# ---------------------------------------------------------------- MLflow


def test_mlflow_still_resolves_model_uris_through_the_process_wide_uris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why tracking.process_uri is still there: in MLflow 3.17 a client's or a call's own
    URIs do not reach the look-ups below. When one of these starts to pass, MLflow has
    fixed it: drop the switch where the message says."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from raylift.artifacts.tracking import client

    monkeypatch.chdir(tmp_path)  # the process-wide store (MLflow's default) lands here
    (tmp_path / "store").mkdir()
    uri = f"sqlite:///{tmp_path / 'store' / 'm.db'}"
    mlflow_client = client(uri)
    exp = mlflow_client.create_experiment("x", (tmp_path / "store" / "mlruns").as_uri())
    run_id = mlflow_client.create_run(exp).info.run_id
    model = mlflow_client.create_logged_model(exp, name="model", source_run_id=run_id)
    mlflow_client.create_registered_model("m")
    with pytest.raises(MlflowException, match="not found"):
        mlflow_client.create_model_version(
            "m", source=f"models:/{model.model_id}", run_id=run_id, model_id=model.model_id
        )
    user = "the process_uri around create_model_version in artifacts.tracking_service"
    assert mlflow.get_tracking_uri() != uri, f"the test's own premise: {user}"
    mlflow_client.create_model_version(  # as the registry takes it with the process's URIs
        "m", source=model.artifact_location, run_id=run_id, await_creation_for=0
    )
    for source in ("models:/m/1", f"runs:/{run_id}/model", f"models:/{model.model_id}"):
        with pytest.raises(MlflowException):
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=str(tmp_path / "got"),
                tracking_uri=uri, registry_uri=uri,
            )  # fmt: skip


def test_dcp_places_a_loaded_item_as_the_planner_does() -> None:
    """tensors/ranged.py's planner loads DCP's non-tensor items itself (checked, weights
    only) and places them as ``DefaultLoadPlanner.load_bytes`` does, with DCP's private
    ``_traverse.set_element``: both must still be there and still do it that way."""
    import inspect

    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    source = inspect.getsource(DefaultLoadPlanner.load_bytes)
    assert "set_element(" in source and "self.original_state_dict" in source, source
    assert "self.mappings[" in source and "torch.load(" in source, source
    tree: dict = {"a": {"b": 1}}
    set_element(tree, ("a", "b"), 2)
    assert tree == {"a": {"b": 2}}


# ---------------------------------------------------------------- the whole list

SRC = Path(raylift.__file__).parent
# Every private name each module of raylift reaches, by the last part of its name: the
# libraries' (above, and in test_ray_private.py), Python's own, and raylift's own marks.
KNOWN: dict[str, set[str]] = {
    "core/console.py": {"_getframe", "_raylift"},  # sys._getframe; raylift's mark on a hook
    "data/sources.py": {"_logical_plan", "_shuffle"},  # Ray: test_ray_private.py
    "run/check.py": {"_private"},  # Ray
    "run/connect.py": {"_raylet"},  # Ray
    "run/failures.py": {"_base_exc"},  # Ray
    "run/faults.py": {"_base_exc", "_exit"},  # Ray; "os._exit" in a message
    "run/launch.py": {"_create_default_callbacks"},  # Ray
    "run/leaving.py": {
        "__ray_call__",
        "_cluster_node_resources",
        "_internal",
        "_lock",
        "_private",
        "_refresh_resource_reservations",
        "_tick",
    },
    "run/loop.py": {"_torchdynamo_orig_callable"},
    "run/plan.py": {"_cdata"},
    "run/wire.py": {"_C", "_distributed_c10d", "_dump_fr_trace_json"},
    "strategies/base.py": {"_fields"},  # a namedtuple's, public
    "strategies/deepspeed.py": {
        "__compatible_ops__",
        "_communication_backend_name",
        "_config",
        "_dynamo",
        "_link_all_hp_params",
        "_ZERO_PARAM_INTRA_PARALLEL_GROUP",  # test_hpz_group_is_a_module_global_made_once
    },
    "strategies/zero_layout.py": {"_get_param_partition_group", "_hp_mapping"},
    "tasks/gpt.py": {"_init"},  # raylift's own GPT
    "tasks/hf.py": {"_no_split_modules"},
    "tensors/init.py": {"_init_weights", "_raylift_unwrapped", "_utils"},
    "tensors/lazytorch.py": {"_utils", "_tensor", "_dtype"},
    "tensors/pickles.py": {"_utils"},  # torch.save's pickle names, as lazytorch's
    "tensors/ranged.py": {"_traverse"},  # DCP: test_dcp_places_a_loaded_item_as_the_planner_does
}
PROTOCOL = {"__init__", "__name__", "__class__", "__dict__", "__file__", "__path__",
            "__module__", "__qualname__", "__doc__", "__cause__", "__subclasses__",
            "__deepcopy__", "__init_subclass__", "__excepthook__", "__stderr__", "__version__",
            "__enter__", "__exit__", "__wrapped__", "__mro__", "__new__"}  # fmt: skip
IN_TEXT = re.compile(r"(?<!self)(?<!cls)\.(_[A-Za-z]\w*)")  # "torch._utils", f"{x._y}"


def private_names(text: str) -> set[str]:
    """``x._name`` (not ``self._name``), ``"pkg._module"`` in a string, and
    ``getattr(x, "_name")``, comments left out."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in skip]
    found: set[str] = set()
    for i, t in enumerate(toks):
        if t.type == tokenize.NAME and t.string.startswith("_") and toks[i - 1].string == ".":
            if toks[i - 2].string not in ("self", "cls"):
                found.add(t.string)
        elif t.type == tokenize.STRING:
            found.update(m.group(1) for m in IN_TEXT.finditer(t.string))
            value = t.string.strip("\"'")
            if re.fullmatch(r"_\w+", value) and _call_of(toks, i) in ("getattr", "hasattr"):
                found.add(value)
    return found - PROTOCOL


def _call_of(toks: list[tokenize.TokenInfo], i: int) -> str | None:
    depth = 0
    for j in range(i - 1, 0, -1):
        if toks[j].string in ")]}":
            depth += 1
        elif toks[j].string in "([{":
            if depth == 0:
                return toks[j - 1].string if toks[j].string == "(" else None
            depth -= 1
    return None


MODULES = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py"))


def test_the_scan_finds_what_it_looks_for() -> None:
    code = 'import torch._dynamo\nx = getattr(m, "_no_split", 1)\nself._mine\n# a._comment\n'
    assert private_names(code) == {"_dynamo", "_no_split"}
    assert len(MODULES) > 60 and "strategies/zero_layout.py" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_no_other_private_name_is_reached(module: str) -> None:
    """The list above is the whole list: a new private use is added there, with a test."""
    unknown = private_names((SRC / module).read_text()) - KNOWN.get(module, set())
    assert not unknown, f"{module} reaches private {sorted(unknown)}, not listed in KNOWN"
