"""A Hugging Face causal language model (``task: hf-causal-lm``; ``pip install 'raylift[hf]'``).

``task_args.model`` is a local folder as ``save_pretrained`` writes it (``config.json``,
safetensors weights, optionally a tokenizer), a Hugging Face Hub ID (``org/name``,
``org/name@revision``: its config and tokenizer fetched into the Hugging Face cache, its
weights read from the Hub at the commit the driver pinned, :mod:`raylift.core.hub`), or
an inline config for training from scratch (``{model_type: llama, hidden_size: 256,
num_hidden_layers: 4, ...}``, the keyword arguments of ``AutoConfig.for_model``).

The folder's weights are the run's initial weights (``model.weights``, when set,
wins). Text comes from the ``gpt`` task's corpus reader (``corpus``, ``text_field``,
``max_bytes``, ``val_percent``), tokenised with the folder's tokenizer, or as bytes
(token = byte value) where there is none; documents are packed into
``block_size + 1``-token windows with an end-of-text token (the tokenizer's, else
byte 0) between them. The transformer layers are found from the model's own
``_no_split_modules`` (for FSDP wrapping, activation checkpointing and compile);
the initial weights are the model's own ``_init_weights``, applied module by module
(``raylift.tensors.init``).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.core import hub, storage
from raylift.core.errors import SourceError
from raylift.tasks.base import Batch, Columns, hf_plan
from raylift.tasks.gpt import GPTTask, documents, windows
from raylift.tensors.weights import INDEX, SINGLE


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            f"task hf-causal-lm needs transformers ({exc}); pip install 'raylift[hf]'"
        ) from None
    return transformers


TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens")


class HFCausalLM(GPTTask):
    """Next-token prediction with any ``AutoModelForCausalLM``."""

    def __init__(
        self,
        model: str | dict[str, Any] = "",
        block_size: int = 128,
        corpus: str = "stdlib",
        max_bytes: int | None = 2_000_000,
        val_percent: int = 5,
        text_field: str = "text",
        split: str = "train",
        subset: str | None = None,
    ):
        super().__init__(
            block_size=block_size,
            corpus=hub_corpus(corpus, split, subset),
            max_bytes=max_bytes,
            val_percent=val_percent,
            text_field=text_field,
        )
        tf = _transformers()
        self.folder: str | None = None  # config and tokenizer, on this machine
        self.hub: hub.HubRef | None = None  # the Hub commit the weights are read from
        self.tokenizer: Any = None
        if isinstance(model, dict):
            args = dict(model)
            if "model_type" not in args:
                raise ValueError("task_args.model: an inline config needs model_type, e.g. llama")
            self.config = tf.AutoConfig.for_model(**args)
        elif model and Path(model).is_dir():
            self._from_folder(tf, str(Path(model).resolve()))
        elif model and (ref := hub.parse(model)) is not None:
            # The driver pinned it to a commit (pin_hub_names); a task built elsewhere
            # (raylift validate, plan) pins it here.
            self.hub = hub.pin(ref, "task_args.model")
            self._from_folder(tf, hub.small_files(self.hub, "task_args.model"))
        else:
            raise ValueError(
                f"task_args.model: {model!r} is neither a local folder nor a Hugging Face "
                "Hub ID (org/name, org/name@revision); give one of them, or an inline config "
                "{model_type: ..., ...}"
            )
        # The model's module imported now, outside any deepspeed.zero.Init: classes
        # defined inside one get their __init__ wrapped, and unwrapped to the one they had
        # at definition when it ends, which drops a decorator's (transformers' MoE experts
        # set their config in theirs) for the rest of the process.
        tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        if self.tokenizer is None and self.config.vocab_size < 256:
            raise ValueError(
                f"task_args.model: vocab_size {self.config.vocab_size} < 256; without a "
                "tokenizer the tokens are bytes"
            )

    def _from_folder(self, tf: Any, folder: str) -> None:
        self.folder = folder
        self.config = tf.AutoConfig.from_pretrained(folder, local_files_only=True)
        if any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def data_version(self) -> str:
        """The corpus's version and, where a tokenizer makes the tokens, a digest of its
        files' contents: a retrained vocabulary or new merges prepare the shards again."""
        corpus = super().data_version()
        if self.tokenizer is None or self.folder is None:
            return corpus
        return f"{corpus} tokenizer {tokenizer_digest(Path(self.folder))}"

    @property
    def pretrained_weights(self) -> str | None:
        """The folder, where it holds weights: the run's initial weights. A Hub model's
        are read where they are, at its pinned commit (``hf://org/name@commit``)."""
        if self.hub is not None:
            sharded = self.folder and (Path(self.folder) / INDEX).is_file()
            has = sharded or storage.is_file(self.hub.uri(SINGLE))
            return self.hub.uri() if has else None
        if self.folder and any((Path(self.folder) / f).is_file() for f in (SINGLE, INDEX)):
            return self.folder
        return None

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    def build_model(self) -> nn.Module:
        # Initialised by its own _init_weights, module by module, as any Hugging Face
        # model a task returns is (raylift.tensors.init).
        tf = _transformers()
        if not _partitioned_as_built():
            return tf.AutoModelForCausalLM.from_config(self.config)
        # As transformers builds under ZeRO-3: its init would index into parameters that
        # zero.Init has already partitioned to nothing (an embedding's padding_idx row).
        # raylift draws every module's weights after, gathered one module at a time.
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = tf.AutoModelForCausalLM.from_config(self.config)
        model.tie_weights()  # what init_weights does besides drawing, skipped with it
        return model

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        names = set(getattr(model, "_no_split_modules", None) or ())
        found = [m for m in model.modules() if type(m).__name__ in names]
        return found or _repeated(model)

    def hf_config(self) -> Any:
        return self.config

    def tp_plan(self, model: nn.Module) -> dict[str, str] | None:
        """The model's own plan (its config's ``base_model_tp_plan``), not gpt's."""
        return hf_plan(model)

    # ------------------------------------------------------------ data

    def preprocess(self, batch: Columns) -> Columns:
        if self.tokenizer is None:
            return super().preprocess(batch)
        texts = [d.decode("utf-8", errors="replace") for d in documents(batch)]
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for piece in self.tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids += piece + ([eos] if eos is not None else [])
        arr = np.asarray(ids, dtype=np.int32)
        return {"tokens": windows(arr, self.block_size)}

    # ------------------------------------------------------------ steps

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(input_ids=batch["tokens"][:, :-1])
        return with_router_loss(self.criterion(out.logits, batch), out, self.config)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        if self.tokenizer is None:
            return super().summarize(sums)  # bytes: bits per byte
        loss = sums["loss_sum"] / max(sums["count"], 1.0)
        return {"val_loss": loss, "val_ppl": float(np.exp(min(loss, 50.0)))}

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        tokens = batch["tokens"]
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        target = tokens[:, 1:]
        loss_sum = F.cross_entropy(
            logits.reshape(-1, self.vocab), target.reshape(-1), reduction="sum"
        )
        return {"loss_sum": loss_sum, "count": torch.tensor(target.numel(), device=target.device)}


def with_router_loss(loss: torch.Tensor, out: Any, config: Any) -> torch.Tensor:
    """A mixture of experts' load-balancing loss added as transformers adds it when given
    labels: ``router_aux_loss_coef`` x ``aux_loss``, where the config asks for the
    router's logits (``output_router_logits``)."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return loss
    return loss + float(getattr(config, "router_aux_loss_coef", 0.0)) * aux.to(loss.dtype)


def _partitioned_as_built() -> bool:
    """Inside ``deepspeed.zero.Init`` (ZeRO-3): each parameter is partitioned as its
    module's constructor returns. DeepSpeed counts the nested contexts it is in."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return bool(getattr(zero, "zero_init_context", 0))


def tokenizer_digest(folder: Path) -> str:
    """A digest of the files a tokenizer is loaded from (not the weights or config): the
    ``tokenizer*``, vocabulary, merges, special- and added-token and sentencepiece files."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        name = path.name
        if path.is_file() and (name.startswith(TOKENIZER_FILES) or name.endswith(".model")):
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _repeated(model: nn.Module) -> list[nn.Module]:
    """The children of the largest ModuleList whose members share one class."""
    lists: list[list[nn.Module]] = [
        list(m)
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]
    return max(lists, key=len) if lists else []


def data_specs(spec: str, split: str, subset: str | None, key: str) -> list[str]:
    """Data named by a task argument as the files to read: a Hub data set's name
    (``org/name``, ``org/name@rev``) as its ``split``'s files at one commit
    (``hf://datasets/...`` globs); a file, folder or glob, local or a URI, as it is."""
    ref = hub.parse(spec, "dataset")
    if ref is None:
        return [spec]
    try:
        return hub.data_files(hub.pin(ref, key), split, subset, key)
    except hub.HubError as exc:
        raise SourceError(str(exc)) from None


def hub_corpus(corpus: str, split: str, subset: str | None) -> str:
    """``task_args.corpus`` as the one folder or glob the corpus reader lists: a Hub data
    set's ``split`` as the glob of its files at one commit."""
    specs = data_specs(corpus, split, subset, "task_args.corpus")
    if len(specs) > 1:
        raise SourceError(
            f"task_args.corpus: {corpus}'s card names {len(specs)} file patterns for split "
            f"{split!r} ({', '.join(specs)}); name the files as one hf://datasets/... glob"
        )
    return specs[0]
