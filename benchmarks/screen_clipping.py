"""How the vote screen's candidates clip their workers' gradients: by the compressed modes' rule (the
default), by the norm of the workers' mean gradient (``+exactclip``, exact Lion's rule, an oracle), or by
the norm of a CountSketch of it (``+sketchclipK``), which a compressed mode can afford
(benchmarks/screen_vote.py's docstring has the candidates and what each suffix measures)."""

from __future__ import annotations

import torch

#: The suffix of a candidate that clips as exact Lion does (benchmarks/screen_vote.py's docstring).
EXACT_CLIP = "+exactclip"
#: The suffix of a candidate that clips by a sketched norm of the mean gradient, followed by the sketch's width.
SKETCH_CLIP = "+sketchclip"


def clip_of(spec: str) -> tuple[str, int]:
    """``spec`` without its clipping suffix, and the sketch width: -1 for ``+exactclip``, 0 for none (the
    compressed modes' clipping), ``K`` for ``+sketchclipK``."""
    if spec.endswith(EXACT_CLIP):
        return spec.removesuffix(EXACT_CLIP), -1
    base, found, width = spec.rpartition(SKETCH_CLIP)
    if found:
        if not width.isdigit() or int(width) < 1:
            raise ValueError(
                f"candidate {spec!r}: write the sketch's width after {SKETCH_CLIP}, e.g. {SKETCH_CLIP}4096"
            )
        return base, int(width)
    return spec, 0


class SketchClip:
    """Clipping by the norm of a CountSketch of the workers' mean gradient (benchmarks/screen_vote.py's docstring).

    Element e of parameter j goes to bin ``bins[j][e]`` with sign ``signs[j][e]``, drawn once from a generator
    seeded with ``seed``; worker i's sketch is ``s_i[b] = sum over e in bin b of sign * g_i[e]``; the
    coefficient is ``min(1, max_norm / (|mean_i s_i| + 1e-6))``, DeepSpeed's formula with the estimate in
    place of the norm.
    """

    def __init__(self, params: list[torch.Tensor], width: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.width = width
        self.bins = [torch.randint(0, width, (p.numel(),), generator=gen) for p in params]
        self.signs = [torch.randint(0, 2, (p.numel(),), generator=gen).float().mul_(2).sub_(1) for p in params]

    def norm_estimate(self, grads: list[list[torch.Tensor]]) -> float:
        """``|mean_i s_i|`` for ``grads[i][j]``, worker i's gradient of parameter j."""
        total = torch.zeros(self.width, dtype=torch.float32)
        for worker in grads:
            for g, bins, signs in zip(worker, self.bins, self.signs, strict=True):
                total.index_add_(0, bins, g.reshape(-1).float() * signs)
        return float(torch.linalg.vector_norm(total / len(grads)))

    def clip(self, grads: list[list[torch.Tensor]], max_norm: float) -> None:
        """Scale every worker's gradients in place by the common coefficient."""
        if max_norm <= 0:
            return
        coef = min(1.0, max_norm / (self.norm_estimate(grads) + 1e-6))
        if coef < 1.0:
            for worker in grads:
                torch._foreach_mul_(worker, coef)
