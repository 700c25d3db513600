"""``cgraw.config``: the process-wide settings of graphed functions.

Layer L6: pure Python. Turning ``autograd`` on or off installs or removes the grad-mode probe
that makes grad mode part of every call's key (``calls.use_grad_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cgraw.trees import calls


@dataclass
class Config:
    """Process-wide settings of graphed functions (``cgraw.config``)."""

    dynamic_shape_warn_limit: int = 8
    skip_dynamic_graphs: bool = False
    generation_cloning: str | None = None  # None or "user_visible"
    warm_cublas: bool = True
    rewarm_limit: int = 8  # a node warmed up again this often (its closure tensors keep moving) runs eagerly
    # a function already this often on the path under way becomes a root (each call begins a
    # generation) instead of deepening the path by one node per call; 0 turns the bound off
    path_repeat_limit: int = 64
    # eager inputs read in place (their kernels' arguments rewritten) where a proof replay shows
    # it safe, instead of copied into a placeholder on every call (cgraw.rebind.proof)
    rebind_inputs: bool = True
    # an eager input under 1 MiB is read in place only if re-pointing it when it moves touches at
    # most this many graph nodes more than updating its copy does (one driver call per node either
    # way); otherwise it keeps its copy (cgraw.rebind.proof.dearer)
    rebind_node_margin: int = 0
    # autograd through graphed functions (cgraw.trees.autograd): outputs require grad and
    # backward() replays a recorded backward; False: outputs are detached from the second call on
    autograd: bool = True
    # a warm-up autograd records nothing in runs inside the tree's pool on its capture stream, as
    # torch's trees do (cgraw.trees.warmup): what it frees is what the recordings reuse, not
    # torch's global cache; its outputs there follow the generation rule
    warmup_in_pool: bool = True
    # torch's cached free memory is released before each recording, as torch.cuda.graph (and so
    # torch's trees) do before every capture: warm-up memory and dropped cuBLAS workspaces are not
    # kept cached beside the tree's pool; False keeps torch's cache warm for eager code
    empty_cache_on_record: bool = True

    def __setattr__(self, name, value):
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"cgraw.config has no setting {name!r}")
        if name == "generation_cloning" and value not in (None, "user_visible"):
            raise ValueError(f"generation_cloning={value!r} must be None or 'user_visible'")
        if name == "rebind_node_margin" and (type(value) is not int or value < 0):
            raise ValueError(f"rebind_node_margin={value!r} must be an int >= 0")
        changed = name == "autograd" and bool(value) != bool(getattr(self, name, False))
        object.__setattr__(self, name, value)
        if changed:
            calls.use_grad_mode(_grad_probe[0] if value else None)


_grad_probe: list = [None]  # [the framework's grad-mode probe] (torch.is_grad_enabled), once known
config = Config()


def grad_probe(probe) -> None:
    """Set the framework's grad-mode probe; grad mode joins the recording key while
    ``config.autograd`` is True (``calls.use_grad_mode``)."""
    _grad_probe[0] = probe
    if config.autograd:
        calls.use_grad_mode(probe)
