"""A zoo of real architectures, as transformers tests itself: a tiny random model of each
(hidden size 64, 2 layers), built from its own config class and saved with
``save_pretrained`` beside a BPE tokenizer trained here, then used through ``task:
hf-causal-lm`` as a user uses a downloaded checkpoint.

Each brings what the tests' own models do not: a ``pad_token_id`` (an embedding whose
init indexes a row), tied and untied heads, Gemma2's soft-capping and its own norm,
Phi-3's fused qkv, GPT-2's Conv1D layers, GPT-NeoX's renamed head, and two mixtures of
experts whose per-expert tensors transformers fuses as it loads (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# What every decoder here shares: small enough for a 2-core machine, big enough for
# grouped-query attention (4 heads over 2 key/value heads).
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
PAD = 3  # a token id of the tokenizer's; its embedding row starts at zero

ZOO: dict[str, dict[str, Any]] = {
    "llama-pad": {"model_type": "llama", **COMMON, "pad_token_id": PAD},
    "llama-tied": {"model_type": "llama", **COMMON, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", **COMMON, "sliding_window": None},
    "qwen2": {"model_type": "qwen2", **COMMON, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **COMMON, "head_dim": 16},
    "gemma2": {
        "model_type": "gemma2", **COMMON, "head_dim": 16, "pad_token_id": PAD,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "query_pre_attn_scalar": 16, "sliding_window": 32,
    },
    "phi3": {"model_type": "phi3", **COMMON, "pad_token_id": PAD},
    # Dropout off (GPT-2's config has it on): a resume on fewer ranks draws its masks in
    # another order, so only a model without it continues the curve exactly.
    "gpt2": {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    },
    "gpt-neox": {
        "model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
    },
    "mixtral": {
        "model_type": "mixtral", **COMMON, "num_local_experts": 4, "num_experts_per_tok": 2,
        "output_router_logits": True, "router_aux_loss_coef": 0.01,
    },
    "qwen3-moe": {
        "model_type": "qwen3_moe", **COMMON, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": True, "router_aux_loss_coef": 0.01,
    },
}  # fmt: skip
MOE = ("mixtral", "qwen3-moe")


def tokenizer(text: list[str]) -> Any:
    """A byte-level BPE of about 300 tokens trained on ``text``, with end-of-text and
    padding tokens, as a folder's ``tokenizer.json`` gives it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    specials = ["[UNK]", "<eos>", "<bos>", "<pad>"]  # <pad> is PAD
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
        unk_token="[UNK]",
    )  # fmt: skip


def zoo_tokenizer() -> Any:
    """The zoo's tokenizer, trained on standard-library text: fixed on a machine, unlike
    the tests' own files, an edit to which would change every zoo run's tokens."""
    from tests.corpora import documents

    return tokenizer(documents(40))


def save_zoo(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Each architecture's folder under ``root``, as ``save_pretrained`` writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = zoo_tokenizer()
    assert tok.convert_tokens_to_ids("<pad>") == PAD
    folders = {}
    for name in names or list(ZOO):
        spec = dict(ZOO[name])
        extra = {"bos_token_id": 2, "eos_token_id": 1}
        config = AutoConfig.for_model(**spec, vocab_size=len(tok), **extra)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        folder = root / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        folders[name] = folder
    return folders


# ------------------------------------------------------------ runs in a pool of ranks

LORA = {"adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": "all-linear"}}
STEPS, RESUME_AT = 4, 2


def zoo_config(folder: Path, strategy: dict[str, Any], lora: bool) -> dict[str, Any]:
    """A few fp32 steps of ``hf-causal-lm`` on the folder, a checkpoint half-way."""
    from tests.helpers import make_config

    more: dict[str, Any] = {"model": LORA} if lora else {}
    return make_config(
        task="hf-causal-lm",
        # 1% held out, the least: the curves compared are training's, and the untrained
        # baseline and the final evaluation were a quarter of the zoo's time at 5%.
        task_args={"model": str(folder), "block_size": 16, "max_bytes": 40_000, "val_percent": 1},
        strategy=strategy,
        # The held-out split in two batches a rank, not nine: the curves compared are
        # training's, and evaluation was most of a run's time under ZeRO-3 (each forward
        # gathers every weight).
        data={"batch_size": 4, "eval_batch_size": 64},
        optim={"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        train={"max_steps": STEPS, "log_every_n_steps": 1, "seed": 0, "grad_clip": 1.0},
        checkpoint={"every_n_steps": RESUME_AT},
        **more,
    ).to_dict()


def probe(vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(7))


def _data(cfg: Any, cache: dict[str, Any]) -> Any:
    """The runs' tokens, made once a job: every folder shares one tokenizer."""
    from raylift.tasks import build_task
    from tests.helpers import tensors

    if "data" not in cache:
        cache["data"] = tensors(build_task(cfg.task, cfg.task_args))
    return cache["data"]


def _logits(trainer: Any, vocab: int) -> torch.Tensor:
    model = trainer.engine.eval_model
    model.eval()  # GPT-2's dropout off, as in a model from_pretrained loads
    with torch.no_grad():
        return model(input_ids=probe(vocab)).logits.float()


def zoo_train(rank: int, world: int, runs: dict[str, dict], root: str) -> None:
    """Train each run to its end, checkpoints under ``root/NAME``; rank 0 saves each
    run's loss curve and its logits on the probe tokens (``root/train.pt``)."""
    import torch.distributed as dist

    from raylift.validation import config_from_dict
    from tests.helpers import ListTracker, LocalReporter, make_trainer, settle

    results, cache = {}, {}
    for name, raw in runs.items():
        cfg = config_from_dict(raw)
        tracker = ListTracker()
        reporter = LocalReporter(Path(root) / name)
        trainer = make_trainer(cfg, rank, world, reporter, tracker, data=_data(cfg, cache))
        trainer.run()
        vocab = trainer.task.vocab
        results[name] = {
            "loss": tracker.series("train_loss"),
            "logits": _logits(trainer, vocab),
            "layout": trainer.engine.layout,
        }
        settle(trainer.engine)
        dist.barrier()
    if rank == 0:
        torch.save(results, Path(root) / "train.pt")


def zoo_resume(rank: int, world: int, runs: dict[str, dict], root: str) -> None:
    """Each run restored from its half-way checkpoint at this world size and trained to
    its end; rank 0 saves the curves (``root/resume-WORLD.pt``)."""
    from raylift.core.parsing import merge
    from raylift.validation import config_from_dict
    from tests.helpers import ListTracker, LocalReporter, make_trainer, settle

    results, cache = {}, {}
    for name, raw in runs.items():
        # Elastic, as a run that lost a worker is: the ranks left accumulate what the
        # others did, so each step sees the same rows as before.
        cfg = config_from_dict(merge(raw, {"scaling": {"num_workers": [1, 2]}}))
        tracker = ListTracker()
        reporter = LocalReporter(Path(root) / f"{name}-resumed-{world}")
        trainer = make_trainer(cfg, rank, world, reporter, tracker, data=_data(cfg, cache))
        trainer.restore(Path(root) / name / f"checkpoint-step{RESUME_AT:08d}")
        trainer.run()
        results[name] = {"loss": tracker.series("train_loss")}
        settle(trainer.engine)
    if rank == 0:
        torch.save(results, Path(root) / f"resume-{world}.pt")
