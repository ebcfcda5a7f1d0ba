"""FSDP2 training backend: ``fully_shard`` over a transformers causal LM.

Verified on CPU with gloo (torch 2.13): fully_shard per decoder layer + root, forward/
backward, ``clip_grad_norm_`` over DTensor grads, ``full_tensor()`` gathering, DCP
save/load and ``module.to()`` all work, so the CPU path is the same code as the GPU one.

What is FSDP-specific lives here: sharding, running the model on micro-batches, gradient
sync, checkpoint format, offload. The step loop, loss, advantages and batching are shared
(``trainer.training.backends.rl_step``, ``trainer.training.algo``,
``trainer.training.backends.batching``) so a Megatron backend computes the same objective.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from transformers import DynamicCache

from trainer.training.algo.losses import token_log_probs, token_log_probs_and_entropy
from trainer.training.backends.base import NamedTensors, bucketed
from trainer.training.backends.batching import (
    BatchLike, MicroBatch, build_micro_batch, build_shared_prefix_micro_batch, check_batch,
    plan_step)
from trainer.training.backends import packed_attention, packed_gdn
from trainer.training.backends.rl_step import StepLoop, per_sample_log_probs
from rollout.checkpoints import is_hybrid, read_config
from rollout.modeling.hybrid import HomegymGatedDeltaNet, transfer_dtype, use_homegym_gdn
from rollout.models import cache_kwarg, keeps_boolean_logits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _full_copy(value: torch.Tensor, device, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``value`` (a DTensor shard or a plain tensor) gathered whole on ``device`` in
    ``dtype``, sharing no storage with it. Each rank casts its shard before the gather,
    which moves that many fewer bytes (the cast is elementwise: the gathered tensor cast)."""
    local = value.to_local() if hasattr(value, "to_local") else value
    if dtype is not None:
        value = value.to(dtype)
    if hasattr(value, "full_tensor"):
        # On a one-rank mesh the shard is the whole tensor: no all-gather (a collective
        # per tensor; tiny-qwen3's push gathered in 8-9 ms that way, 4 ms without).
        full = value.to_local() if value.device_mesh.size() == 1 else value.full_tensor()
    else:
        full = value
    full = full.to(device)
    # The gather's output is already a fresh tensor; only a tensor that is (a view of) the
    # parameter itself needs copying.
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()
    return full


def _kept(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logits at the ``keep`` positions, flattened row-major. With a boolean
    ``logits_to_keep`` transformers already returns them so; a model that ignores it
    returns every position."""
    return logits if logits.dim() == 2 else logits[keep]


# One fused kernel over all parameters. On CPU torch otherwise runs its per-tensor loop
# (a dozen dispatched ops per parameter): tiny-qwen3's optimizer step took 14-15 ms that way,
# 1.7 ms fused (scripts/bench_train_step.py; docs/performance.md, "homegym vs TRL").
_ADAMW_IMPL = {"fused": True, "foreach": None}


class FSDPBackend(StepLoop):
    """One training rank. Call ``init`` after ``torch.distributed`` is initialised."""

    def init(self, model, train, algo, warmup, cluster, *, rank: int, world_size: int,
             share_prompts: bool, total_optimizer_steps: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(cluster.torch_threads)
        self.model_cfg, self.train, self.algo, self.warmup = model, train, algo, warmup
        self.share_prompts = share_prompts
        self.rank, self.world_size = rank, world_size
        if cluster.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(train.seed)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.lora = train.lora if train.lora.enabled else None
        self.lora_layers: dict[str, float] = {}  # adapted module -> scaling (LoRA runs)
        self.model = self._build_model(trainable=True)
        self.use_ref = algo.kl_coef > 0
        # A LoRA policy's reference is its own base: the model with adapters switched off.
        self.ref_model = (self._build_model(trainable=False)
                          if self.use_ref and self.lora is None else None)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2), weight_decay=train.weight_decay,
            **_ADAMW_IMPL)
        self.optimizer_steps = 0  # RL optimizer steps (drives the LR schedule)
        self.sft_steps = 0
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.cache_kw = cache_kwarg(self.model)
        # Otherwise the LM head runs at every position and _kept selects (more work).
        self.bool_keep = keeps_boolean_logits(self.model)
        self.total_optimizer_steps = total_optimizer_steps

    def _build_model(self, *, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        from rollout.models import resolve_model_path

        cfg = self.model_cfg
        path = resolve_model_path(cfg.path, cfg.cache_dir)
        dtype = _DTYPES[cfg.dtype]
        # Master weights stay fp32 (AdamW on bf16 weights loses small updates); a lower
        # model.dtype becomes FSDP's compute dtype. The reference model never steps.
        # A hybrid reference too: its fp32 A_log must not round through bf16 on loading.
        load_dtype = torch.float32 if trainable or is_hybrid(read_config(path)) else dtype
        # Shared prefixes need their own attention (SDPA over re-padded packed suffixes).
        attn = (packed_attention.register() if self.share_prompts
                else cfg.attn_implementation)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype,
                                                     attn_implementation=attn)
        model.config.use_cache = False
        # Hybrid models (Qwen3.5): Gated DeltaNet layers that take packed sequences and states.
        self.hybrid = use_homegym_gdn(model) > 0
        if self.lora is not None and trainable:
            from trainer.training.backends.lora import apply_lora

            self.lora_layers = apply_lora(model, self.lora)
        if self.train.gradient_checkpointing and trainable:
            model.gradient_checkpointing_enable()
            if self.lora is not None:  # frozen embeddings: checkpointed inputs need grad
                model.enable_input_require_grads()
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        layers = getattr(getattr(model, "model", model), "layers", [])
        for layer in layers:
            if dtype != torch.float32:
                self._keep_gdn_decay_fp32(layer, mp)
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        model.to(self.device)
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _keep_gdn_decay_fp32(self, layer: torch.nn.Module, mp) -> None:
        """A Gated DeltaNet's own parameters (A_log, dt_bias, the conv) in their own FSDP
        unit with fp32 compute, its projections and norm in ``mp``'s: engines and checkpoints
        keep A_log in fp32 (SGLang 0.5.18 qwen3_5.py), and one FSDP unit casts all of its
        parameters to the compute dtype. dt_bias is rounded to the compute dtype where it is
        used (rollout.modeling.gated_deltanet), as an engine holding it in bf16 has it."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Inputs pass as they are: the projections cast them to the compute dtype.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
        for module in layer.modules():
            if isinstance(module, HomegymGatedDeltaNet):
                for name, child in module.named_children():
                    # conv1d's weight is read by the GDN math, never through conv1d's
                    # forward, so a unit of its own would never be unsharded: it stays in
                    # the fp32 unit and is rounded to the compute dtype where used.
                    if name != "conv1d" and any(True for _ in child.parameters()):
                        fully_shard(child, mesh=self.mesh, mp_policy=mp)
                fully_shard(module, mesh=self.mesh, mp_policy=fp32)

    # ----------------------------------------------------------------- forward passes
    def _micro_batch(self, batch: BatchLike, sample_ids: list[int]) -> MicroBatch:
        build = build_shared_prefix_micro_batch if self.share_prompts else build_micro_batch
        return build(batch, sample_ids, pad_token_id=self.pad_token_id,
                     dedupe=self.train.dedupe_samples)

    def _forward(self, model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Flat log-probs (and entropies) of mb's response tokens."""
        mb = mb.to(self.device)
        if mb.shared is not None:
            selected = self._shared_prefix_logits(model, mb)
        else:
            # The LM head runs only where a response token is predicted (a boolean
            # logits_to_keep: transformers returns those positions flattened, row-major).
            keep = torch.zeros(mb.input_ids.shape, dtype=torch.bool, device=self.device)
            keep[mb.row_idx, mb.col_idx] = True
            logits = _kept(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                 logits_to_keep=self._keep(keep), use_cache=False).logits, keep)
            flat = keep.flatten().cumsum(0) - 1  # position -> row of the kept logits
            selected = logits[flat[mb.row_idx * keep.shape[1] + mb.col_idx]]
        if with_entropy:
            return token_log_probs_and_entropy(selected, mb.targets, entropy_grad=entropy_grad)
        return token_log_probs(selected, mb.targets), None

    def _keep(self, keep: torch.Tensor):
        return keep if self.bool_keep else 0  # 0: every position

    def _shared_prefix_logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Logits predicting each response token of a shared-prefix micro-batch: each
        distinct prefix runs once (keeping its KV cache, with grad), then the packed
        suffixes attend to their prefix's KV through ``packed_attention``."""
        s = mb.shared
        # Gated DeltaNet layers (hybrid models) keep their prefixes' final states instead.
        prefix_gdn = packed_gdn.prefix_batch() if self.hybrid else None
        gdn = {"gdn": prefix_gdn} if self.hybrid else {}
        out = model(input_ids=s.prefix_ids, attention_mask=s.prefix_mask, use_cache=True,
                    logits_to_keep=self._keep(s.prefix_keep), **{self.cache_kw: DynamicCache()},
                    **gdn)
        cache = out[self.cache_kw]
        prefix_kv = packed_attention.PackedPrefix(
            keys=[layer.keys for layer in cache.layers],
            values=[layer.values for layer in cache.layers], layout=s)
        if self.hybrid:
            gdn = {"gdn": packed_gdn.suffix_batch(prefix_gdn, s)}
        suffix = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=s.position_ids, logits_to_keep=self._keep(s.keep), use_cache=False,
                       packed_prefix=prefix_kv, **gdn).logits
        logits = torch.cat([_kept(suffix, s.keep), _kept(out.logits, s.prefix_keep)])
        return logits[s.logit_idx]

    @torch.no_grad()
    def _no_grad_log_probs(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return [self._forward(model, mb, with_entropy=False)[0] for mb in mbs]

    def _ref_log_probs(self, mbs: list[MicroBatch]) -> Optional[list[torch.Tensor]]:
        if not self.use_ref:
            return None
        self.model.eval()
        if self.ref_model is not None:
            return self._no_grad_log_probs(self.ref_model, mbs)
        from trainer.training.backends.lora import adapters_disabled

        with adapters_disabled(self.model):
            return self._no_grad_log_probs(self.model, mbs)

    def _plan(self, batch: BatchLike, global_batch_size: Optional[int], skip=frozenset()):
        return plan_step(batch, rank=self.rank, world_size=self.world_size,
                         global_batch_size=global_batch_size,
                         max_tokens=self.train.max_tokens_per_micro_batch,
                         keep_groups=self.share_prompts, skip=skip)

    def log_probs(self, batch: BatchLike) -> list[torch.Tensor]:
        check_batch(batch)
        plan = self._plan(batch, None)[0]
        mbs = [self._micro_batch(batch, ids) for ids in plan]
        self.model.eval()
        return per_sample_log_probs(mbs, self._no_grad_log_probs(self.model, mbs),
                                    num_samples=len(batch.tokens))

    # ----------------------------------------------------------------- training
    # StepLoop's hooks; the loop itself is trainer.training.backends.rl_step.
    def _policy_log_probs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        self.model.eval()
        return self._no_grad_log_probs(self.model, mbs)

    def _accumulate(self, mbs: list[MicroBatch], loss_of, *, with_entropy: bool,
                    entropy_grad: bool = False) -> None:
        self.model.train()
        for j, mb in enumerate(mbs):
            logp, entropy = self._forward(self.model, mb, with_entropy=with_entropy,
                                          entropy_grad=entropy_grad)
            # Reduce-scatter only after the last micro-batch of the optimizer step.
            self.model.set_requires_gradient_sync(j == len(mbs) - 1)
            # FSDP averages gradients over ranks: scaling by world_size makes the SUM.
            (loss_of(j, mb, logp, entropy) * self.world_size).backward()

    def _optimizer_step(self) -> float:
        """Clip, step, zero; returns the global grad norm (before clipping)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.train.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _all_reduce_metrics(self, sums: dict[str, torch.Tensor], keys) -> dict[str, float]:
        # Every rank computes a loss, so the names present are the same on all of them.
        names = sorted(sums)
        if not names:
            return {}
        flat = torch.stack([sums[k].detach().float().reshape(()) for k in names]).to(self.device)
        dist.all_reduce(flat)
        return {k: float(v) for k, v in zip(names, flat.cpu())}

    # ----------------------------------------------------------------- weights
    def _full_state(self, device: str, *, adapters_only: bool = False,
                    dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's state in state_dict order as gathered full tensors on ``device``
        (collective: every rank must drain it), copies that share no storage with the
        model. Tied weights (lm_head sharing the embedding) appear once, under the name
        the HF checkpoint stores. ``dtype``: each rank casts its shard before the gather,
        which moves and copies that many fewer bytes (the cast is elementwise, so the
        result is the gathered tensor cast)."""
        for name, value in self._state_items(adapters_only):
            yield name, _full_copy(value, device, transfer_dtype(name, dtype))

    def _state_items(self, adapters_only: bool = False) -> list[tuple[str, torch.Tensor]]:
        # named_parameters() lists a shared parameter once, under its first name.
        unique = {n for n, _ in self.model.named_parameters()}
        tied = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} - unique
        return [(name, value.detach()) for name, value in self.model.state_dict().items()
                if name not in tied and not (adapters_only and ".lora_" not in name)]

    def _host_buckets(self, bucket_bytes: int, dtype: Optional[torch.dtype]) -> Iterator[NamedTensors]:
        """named_weight_buckets through shared memory (ranks on one host, CPU): each
        bucket's shards go into one /dev/shm buffer instead of a gloo gather per tensor."""
        from trainer.weight_sync.host_gather import HostGather

        if getattr(self, "_host_gather", None) is None:
            self._host_gather = HostGather(self.rank, self.world_size)
        host = self._host_gather
        items = self._state_items()
        # Tensors sent in another dtype than the rest (a GDN's A_log stays fp32) go last,
        # in a bucket of their own: one shared buffer holds one dtype.
        kept = [(n, v) for n, v in items if transfer_dtype(n, dtype) != dtype]
        plan = list(bucketed([(n, v) for n, v in items if transfer_dtype(n, dtype) == dtype],
                             bucket_bytes,
                             nbytes=lambda v: v.numel() * (dtype or v.dtype).itemsize))
        plan.append(kept)
        for key, named in enumerate(plan):
            wire = transfer_dtype(named[0][0], dtype) if named else dtype
            if (named and host.can_gather([v for _, v in named])
                    and len({wire or v.dtype for _, v in named}) == 1):
                yield host.gather(key, named, wire)
            elif named:
                yield [(n, _full_copy(v, "cpu", wire)) for n, v in named]

    def named_weight_buckets(self, bucket_bytes: int, device: str = "cpu",
                             dtype: Optional[torch.dtype] = None) -> Iterator[NamedTensors]:
        """Gathered full tensors under HF names, ~bucket_bytes per bucket, on ``device``
        (a copy: the caller may keep or share them while training goes on), in ``dtype``
        (None: the fp32 master weights; ``transfer_dtype`` keeps a few fp32). A LoRA policy
        yields its merged weights (trainer.training.backends.lora.merged_tensors).

        Collective: every rank must drain the iterator.
        """
        if self.lora is not None:
            from trainer.training.backends.lora import merged_tensors

            # Merged in the master weights' precision, cast after.
            items = merged_tensors(self._full_state(device), self.lora_layers)
            if dtype is not None:
                items = ((n, t.to(transfer_dtype(n, dtype))) for n, t in items)
        elif device == "cpu" and self.device.type == "cpu" and self.world_size > 1:
            yield from self._host_buckets(bucket_bytes, dtype)
            return
        else:
            items = self._full_state(device, dtype=dtype)
        yield from bucketed(items, bucket_bytes)

    def adapter_tensors(self, device: str = "cpu") -> NamedTensors:
        """A LoRA policy's adapter matrices, gathered, under peft's saved names (collective)."""
        from trainer.training.backends.lora import adapter_tensors

        return list(adapter_tensors(self._full_state(device, adapters_only=True)))

    def save_adapter(self, out_dir: str) -> None:
        """Rank 0 writes the adapter in peft format (every rank takes part in the gathers)."""
        from trainer.training.backends.lora import save_adapter
        from rollout.models import resolve_model_path

        tensors = dict(self.adapter_tensors())
        if self.rank == 0:
            cfg = self.model_cfg
            save_adapter(tensors, self.lora, resolve_model_path(cfg.path, cfg.cache_dir), out_dir)

    # ----------------------------------------------------------------- checkpoints
    def _state_dict_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A LoRA checkpoint holds the adapters and their optimizer state; the frozen base
        # comes back from model.path when the run resumes.
        lora = self.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _model_state(self, model_sd: dict) -> dict:
        # ignore_frozen_params still lists a tied frozen weight (lm_head = embedding).
        if self.lora is None:
            return model_sd
        return {k: v for k, v in model_sd.items() if ".lora_" in k}

    def save(self, path: str) -> None:
        """Sharded DCP checkpoint of model + optimizer, plus per-rank RNG and counters."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        os.makedirs(path, exist_ok=True)
        # get_state_dict gives an optimizer without state one by stepping it with zero
        # gradients at lr 0 (torch's _init_optim_state): Adam's step count becomes 1, and
        # the first real update would be 0.74x what it should (bias correction). Such an
        # optimizer is saved as fresh and left fresh, here and in a run that loads it.
        fresh = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=self._state_dict_options())
        model_sd = self._model_state(model_sd)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
        if fresh:
            self.optimizer.state.clear()
        extra = {"optimizer_steps": self.optimizer_steps, "sft_steps": self.sft_steps,
                 "optimizer_fresh": fresh,
                 "cpu_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}
        torch.save(extra, os.path.join(path, f"rank{self.rank}.pt"))
        dist.barrier()

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not os.path.isdir(os.path.join(path, "dcp")):
            raise ValueError(f"{path!r} is not an FSDP checkpoint directory (no dcp/)")
        options = self._state_dict_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": self._model_state(model_sd), "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        for group in self.optimizer.param_groups:  # a checkpoint's groups carry their own
            group.update(_ADAMW_IMPL)
        extra = torch.load(os.path.join(path, f"rank{self.rank}.pt"), weights_only=False)
        if extra.get("optimizer_fresh"):  # see save()
            self.optimizer.state.clear()
        self.optimizer_steps, self.sft_steps = extra["optimizer_steps"], extra["sft_steps"]
        torch.set_rng_state(extra["cpu_rng"])
        if extra["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(extra["cuda_rng"])

    # ----------------------------------------------------------------- memory
    def offload(self) -> None:
        """GPU: move parameters, grads and optimizer state to host memory so colocated
        engines get the GPU. CPU: nothing to free, a no-op."""
        if self.device.type != "cuda":
            return
        self._move("cpu")
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type != "cuda":
            return
        self._move(self.device)

    def _move(self, device) -> None:
        for model in (self.model, self.ref_model):
            if model is not None:
                model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device, non_blocking=True)
        if device == "cpu":
            torch.cuda.synchronize()
