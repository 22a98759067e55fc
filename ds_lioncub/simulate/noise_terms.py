"""The gradient noise scale's terms computed exactly from every worker's gradient (the virtual world has them all).

Why: LionCub's ranks estimate the noise scale from option ``clip``'s sketch (:mod:`ds_lioncub.step.noise_scale`);
the virtual world holds each worker's whole gradient, so a study can read the task's B_simple without the
sketch's error, through the same estimator. The "sketch" here is the summed gradient itself (every coordinate
its own bin), so :func:`~ds_lioncub.step.noise_scale.step_estimates` reads exact norms.
"""

from __future__ import annotations

import torch

from ds_lioncub.step.noise_scale import step_estimates


def exact_noise_terms(grads: list[list[torch.Tensor]]) -> tuple[float, float] | None:
    """One step's ``(|G|^2, tr(Sigma) per voter batch)`` from ``grads[i][j]``, worker i's gradient of tensor j, in
    fp64; None when a gradient is not finite. The voters are the workers: b is one worker's batch."""
    voters = len(grads)
    summed = torch.cat(
        [torch.stack([g.double().flatten() for g in tensors]).sum(dim=0) for tensors in zip(*grads, strict=True)]
    )
    squares = sum(float(torch.linalg.vector_norm(g.double()) ** 2) for tensors in grads for g in tensors)
    return step_estimates(torch.cat([summed, summed.new_tensor([squares])]), voters)
