"""A training-benchmark candidate: a base setup and its modifiers, written `BASE@MODIFIER@...` (`auto@bf16grad@nop2p`).

The modifier `@customloop` times TensorFlow's custom-training-guide loop instead of `model.fit`.

Bases: `1gpu` (plain Keras, no strategy), `onedevice` (TensorFlow's OneDeviceStrategy on the first device: a
strategy scope without replicas' machinery), `stock` (`tf.distribute.MirroredStrategy()` as TensorFlow gives it),
`auto` and the cross-device ops names (`tf_nvlink.strategy(cross_device_ops=...)`), `workers` (one
MultiWorkerMirroredStrategy process per GPU). Modifiers for every base change the worker's environment or input;
the strategy modifiers are arguments of a single-process tf_nvlink strategy.

Example:
    >>> candidate = Candidate.parse("auto@nop2p@bf16grad")
    >>> candidate.base, candidate.bf16grad, candidate.nop2p, candidate.label
    ('auto', True, True, 'auto@bf16grad@nop2p')
"""

from __future__ import annotations

import dataclasses

OPS_BASES = ("auto", "collective", "nccl", "reduce_to_one", "hierarchical")
BASES = ("1gpu", "onedevice", "stock") + OPS_BASES + ("workers",)
# What each modifier does; the order here is the order of a label's modifiers.
STRATEGY_MODIFIERS = {
    "split": "XLA all-reduce mode split, outside the compiled step",
    "fused": "XLA all-reduce mode fused, inside the compiled step",
    "nolhs": "xla_flags='none': no latency-hiding scheduler",
    "bf16grad": "allreduce_dtype='bfloat16'",
    "buffer1": "input_buffer=1, TensorFlow's default prefetch depth",
    "nosync": "TF_NVLINK_SYNC_NON_TRAINABLE=0: replicas keep their own BatchNorm statistics",
}
ANY_BASE_MODIFIERS = {
    "nocudagraphs": "XLA_FLAGS=--xla_gpu_enable_command_buffer=, no CUDA graphs",
    "ondevice": "the batch held on each device, indices from the host",
    "nop2p": "NCCL_P2P_DISABLE=1, NCCL through host memory",
    "customloop": "a custom training loop, strategy.run of a tf.function step, instead of model.fit; not for workers",
}
MODIFIERS = {**STRATEGY_MODIFIERS, **ANY_BASE_MODIFIERS}
# NCCL has no CPU kernels, HierarchicalCopyAllReduce falls back to reduce-to-one on CPU devices, fused XLA
# all-reduce is GPU-only, NCCL_P2P_DISABLE means nothing without GPUs.
GPU_ONLY_BASES = ("nccl", "hierarchical")
GPU_ONLY_MODIFIERS = ("nop2p", "fused")
NO_CUDA_GRAPHS_XLA_FLAG = "--xla_gpu_enable_command_buffer="


def _valid_choices() -> str:
    return (f"bases {list(BASES)}, each optionally with modifiers "
            + ", ".join(f"'@{name}' ({what})" for name, what in ANY_BASE_MODIFIERS.items())
            + "; for tf_nvlink single-process strategies also "
            + ", ".join(f"'@{name}' ({what})" for name, what in STRATEGY_MODIFIERS.items()))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setup the training benchmark measures. `label` is its `BASE@MODIFIER...` text (modifiers in MODIFIERS
    order), and `Candidate.parse(c.label) == c`.

    Example:
        >>> Candidate.parse("auto@split").xla_allreduce
        'split'
        >>> Candidate("auto", nop2p=True).label
        'auto@nop2p'
    """

    base: str
    xla_allreduce: str = "auto"  # "split" / "fused" from the modifiers of those names
    nolhs: bool = False
    bf16grad: bool = False
    buffer1: bool = False
    nosync: bool = False
    nocudagraphs: bool = False
    ondevice: bool = False
    nop2p: bool = False
    customloop: bool = False

    def __post_init__(self):
        if self.base not in BASES:
            raise ValueError(f"Unknown candidate base {self.base!r}; valid: {_valid_choices()}.")
        if self.xla_allreduce not in ("auto", "split", "fused"):
            raise ValueError(f"xla_allreduce should be one of ['auto', 'split', 'fused']. "
                             f"Received: {self.xla_allreduce!r}")
        used = [name for name in STRATEGY_MODIFIERS if name in self.modifiers]
        if used and not self.is_tf_nvlink_strategy:
            raise ValueError(f"Candidate {self.label!r}: {['@' + x for x in used]} are arguments of a "
                             f"single-process tf_nvlink strategy; {self.base!r} has none (only "
                             f"{', '.join(repr('@' + x) for x in ANY_BASE_MODIFIERS)} apply).")
        if self.customloop and self.base == "workers":
            raise ValueError(f"Candidate {self.label!r}: '@customloop' runs in one process; 'workers' measures "
                             f"model.fit only.")

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        """"auto@bf16grad@nop2p" -> Candidate, with an error naming the bad token and the valid choices.

        Example:
            >>> Candidate.parse("workers@nop2p").nop2p
            True
        """
        base, *modifiers = text.strip().split("@")
        if base not in BASES:
            raise ValueError(f"Unknown candidate {text!r}: no base {base!r}; valid: {_valid_choices()}.")
        for modifier in modifiers:
            if modifier not in MODIFIERS:
                raise ValueError(f"Unknown candidate {text!r}: no modifier '@{modifier}'; valid: {_valid_choices()}.")
            if modifiers.count(modifier) > 1:
                raise ValueError(f"Unknown candidate {text!r}: '@{modifier}' given twice; valid: {_valid_choices()}.")
        if {"split", "fused"} <= set(modifiers):
            raise ValueError(f"Unknown candidate {text!r}: '@split' and '@fused' are two XLA all-reduce modes, pick "
                             f"one; valid: {_valid_choices()}.")
        mode = "split" if "split" in modifiers else "fused" if "fused" in modifiers else "auto"
        flags = {name: name in modifiers for name in MODIFIERS if name not in ("split", "fused")}
        return cls(base, xla_allreduce=mode, **flags)

    @property
    def modifiers(self) -> tuple[str, ...]:
        """The modifier names set, in MODIFIERS order."""
        return tuple(name for name in MODIFIERS
                     if (self.xla_allreduce == name) or (name not in ("split", "fused") and getattr(self, name)))

    @property
    def label(self) -> str:
        return "@".join((self.base,) + self.modifiers)

    def __str__(self) -> str:
        return self.label

    @property
    def is_tf_nvlink_strategy(self) -> bool:
        """A single-process `tf_nvlink.strategy(cross_device_ops=base)` (the strategy modifiers apply)."""
        return self.base in OPS_BASES

    @property
    def one_device(self) -> bool:
        """A one-device baseline: plain Keras or OneDeviceStrategy."""
        return self.base in ("1gpu", "onedevice")

    @property
    def needs_gpu(self) -> bool:
        return self.base in GPU_ONLY_BASES or any(name in self.modifiers for name in GPU_ONLY_MODIFIERS)

    def without(self, modifier: str) -> "Candidate":
        """This candidate less one modifier (itself when it has none of that name): the other half of a pair.

        Example:
            >>> Candidate.parse("auto@bf16grad@nop2p").without("nop2p").label
            'auto@bf16grad'
        """
        if modifier not in MODIFIERS:
            raise ValueError(f"modifier should be one of {list(MODIFIERS)}. Received: {modifier!r}")
        if modifier not in self.modifiers:
            return self
        if modifier in ("split", "fused"):
            return dataclasses.replace(self, xla_allreduce="auto")
        return dataclasses.replace(self, **{modifier: False})

    def worker_env(self, environ: dict) -> dict[str, str]:
        """The environment variables this candidate's worker process gets on top of `environ` (the runner's).

        Example:
            >>> Candidate.parse("auto@nocudagraphs").worker_env({})
            {'XLA_FLAGS': '--xla_gpu_enable_command_buffer='}
        """
        env = {}
        if self.nop2p:
            env["NCCL_P2P_DISABLE"] = "1"
        if self.nosync:
            env["TF_NVLINK_SYNC_NON_TRAINABLE"] = "0"
        if self.nocudagraphs:  # after the user's flags: XLA takes a flag's last value
            env["XLA_FLAGS"] = " ".join(x for x in (environ.get("XLA_FLAGS", ""), NO_CUDA_GRAPHS_XLA_FLAG) if x)
        return env


def parse_list(text: str) -> list[Candidate]:
    """"1gpu,auto,nccl@nop2p" -> [Candidate, ...], with a clear error for an empty list or a bad candidate.

    Example:
        >>> [c.label for c in parse_list("1gpu, auto@split")]
        ['1gpu', 'auto@split']
    """
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError(f"candidates should be a comma list of {_valid_choices()}. Received: {text!r}")
    return [Candidate.parse(name) for name in names]
