"""Which parameters get their momentum synchronised.

Selection is by parameter name, as in ``module.named_parameters()``: a list of regexes (each
searched in the name, so ``"lm_head"`` selects ``"lm_head.weight"``), ``"all"``, or ``"auto"``,
which needs the module: every ``nn.Embedding`` weight and the parameters of the output head (the
last ``nn.Linear`` in module order). These are the layers whose momentum differs most between
workers in the Lion Cub paper.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ds_lioncub.errors import LionCubConfigError


def output_head_and_embeddings(module: nn.Module) -> list[torch.Tensor]:
    """The parameters "auto" selects: embedding weights and the last nn.Linear's parameters."""
    selected = [m.weight for m in module.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if linears:
        selected.extend(linears[-1].parameters())
    return selected


def names_by_position(param_groups: Sequence[dict[str, Any]], module: nn.Module | None) -> list[str] | None:
    """Every parameter's name by flat position (group order, then parameter order): from the groups'
    ``param_names`` (an optimizer built from ``named_parameters()``) or else ``module``; None if one has none."""
    from_module = {}
    if module is not None:
        from_module = {id(p): name for name, p in module.named_parameters()}
    names: list[str] = []
    for group in param_groups:
        given = group.get("param_names")
        for position, param in enumerate(group["params"]):
            name = given[position] if given else from_module.get(id(param))
            if name is None:
                return None
            names.append(name)
    return names


def select_parameters(
    params: Sequence[torch.Tensor],
    names: Sequence[str] | None,
    layers: list[str] | str,
    module: nn.Module | None,
) -> list[bool]:
    """For each of ``params``, whether ``layers`` selects it.

    Raises :class:`~ds_lioncub.errors.LionCubConfigError` when the selection needs names or a module
    that were not given.
    """
    if layers == "all":
        return [True] * len(params)
    if layers == "auto":
        if module is None:
            raise LionCubConfigError(
                "LionCub: momentum_sync layers='auto' needs the model to find its embeddings and output head; "
                "pass module=model to LionCub (DeepSpeed passes the engine's module), or list the layers as regexes."
            )
        chosen = {id(t) for t in output_head_and_embeddings(module)}
        return [id(p) in chosen for p in params]
    if names is None:
        raise LionCubConfigError(
            "LionCub: momentum_sync layers are regexes over parameter names, but the parameters have no names; "
            "pass model.named_parameters() (or module=model) to LionCub."
        )
    patterns = [re.compile(pattern) for pattern in layers]
    selection = [any(pattern.search(name) for pattern in patterns) for name in names]
    unmatched = [pattern.pattern for pattern in patterns if not any(pattern.search(name) for name in names)]
    if unmatched:
        raise LionCubConfigError(
            f"LionCub: momentum_sync layers {unmatched} match no parameter name; names look like "
            f"{list(names)[:4]}. Fix the regexes."
        )
    return selection
