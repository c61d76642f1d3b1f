"""Burgers' finite-volume residuals ("upwind", "muscl"), undivided and on a block of the grid.

Owns the one-dimensional scheme Phi (a time step of a row of cells, Engquist-Osher flux,
first order or MUSCL + SSP-RK2) and the k-step residuals (u[i] - Phi^k(u[i-k])) / (k dt) that
``Burgers`` (``burgers.py``, where the schemes are specified) turns into its "pde" term.

On a split block (``diffnet.domain.Block``) the residual of a node needs the rows k above it
and, along x, the cells the k steps reach: each application of the flux difference reads 2
cells per side, so a step reads 2 ("upwind") or 4 ("muscl", two stages) and k steps 2k or 4k.
The block takes one halo of that width and marches a WINDOW of cells wider than its own,
re-imposing at every stage the global ghost states where the window passes the global
boundary (0 left of x = 0, copies of the last node right of x = 1, the inflow 0 at x = 0
after each step), so its own cells come out as the undivided scheme's, exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from diffnet.problems.contract.blocks import check_halo_width

FV_SCHEMES = ("upwind", "muscl")
_STEP_WIDTH = {"upwind": 2, "muscl": 4}    # cells per side one time step reads


class FiniteVolumeResiduals:
    """Mixin of ``Burgers``: needs ``scheme``, ``limiter``, ``spacing``, ``grid``, ``horizon``
    and ``block``."""

    def _limited_slope(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Limited slope from the backward / forward differences a, b (zero at extrema)."""
        aa, ab = a.abs(), b.abs()
        if self.limiter == "minmod":
            mag = torch.minimum(aa, ab)
        elif self.limiter == "vanleer":
            mag = 2 * aa * ab / (aa + ab).clamp_min(1e-30)
        elif self.limiter == "mc":
            mag = torch.minimum(torch.minimum(2 * aa, 2 * ab), 0.5 * (aa + ab))
        else:  # superbee
            mag = torch.maximum(torch.minimum(2 * aa, ab), torch.minimum(aa, 2 * ab))
        # (sign a + sign b) / 2 is sign a where the signs agree and 0 where they differ; where
        # one is 0, every limiter's mag is 0. So this is where(a b > 0, sign(a) mag, 0)
        # without the mask, which costs several multiplications on CPU (lab/notes/performance.md)
        return 0.5 * (torch.sign(a) + torch.sign(b)) * mag

    def _flux_difference(self, e: torch.Tensor) -> torch.Tensor:
        """(F[j+1/2] - F[j-1/2]) / dx for the cells e[..., 2:-2] of a row e (..., n) whose
        first and last 2 cells are ghosts (n - 4 results), Engquist-Osher flux."""
        dx = self.spacing[1]
        if self.scheme == "upwind":
            ul, ur = e[..., 1:-2], e[..., 2:-1]
        else:
            d = e[..., 1:] - e[..., :-1]
            s = self._limited_slope(d[..., :-1], d[..., 1:])      # slopes of e[1 .. n-2]
            ul = e[..., 1:-2] + 0.5 * s[..., :-1]
            ur = e[..., 2:-1] - 0.5 * s[..., 1:]
        flux = 0.5 * (ul.clamp_min(0).square() + ur.clamp_max(0).square())   # n - 3 faces
        return (flux[..., 1:] - flux[..., :-1]) / dx

    def _fv_operator(self, v: torch.Tensor) -> torch.Tensor:
        """(F[j+1/2] - F[j-1/2]) / dx for the rows of v (..., W), Engquist-Osher flux."""
        z = torch.zeros_like(v[..., :1])
        last = v[..., -1:]
        return self._flux_difference(torch.cat([z, z, v, last, last], dim=-1))  # 2 ghosts/side

    def step(self, v: torch.Tensor) -> torch.Tensor:
        """One time step dt = T / (H - 1) of the finite-volume scheme applied to rows v (..., W);
        column 0 of the result is the inflow value 0."""
        dt = self.spacing[0]
        if self.scheme == "upwind":
            w = v - dt * self._fv_operator(v)
        else:
            w = v - dt * self._fv_operator(v)
            w = 0.5 * (v + w - dt * self._fv_operator(w))
        return torch.cat([torch.zeros_like(w[..., :1]), w[..., 1:]], dim=-1)

    def horizons(self) -> tuple[int, ...]:
        """Step counts k of the k-step residuals: 1, 2, 4, ... <= min(horizon, H - 1)."""
        ks, k = [], 1
        while k <= min(self.horizon, self.grid[0] - 1):
            ks.append(k)
            k *= 2
        return tuple(ks)

    def fv_residuals(self, u: torch.Tensor, ks=None) -> list[torch.Tensor]:
        """The k-step residuals (B, 1, *shape) of u for every k of ``ks`` (ascending; default
        ``horizons()``) on ``self.block``: the whole grid's march, or on a split block its part
        by a march of its halo window (``_fv_residuals_part``)."""
        if self.block.whole:
            return self._fv_residuals(u, ks)
        return self._fv_residuals_part(u, ks)

    def _fv_residuals(self, u: torch.Tensor, ks=None) -> list[torch.Tensor]:
        """For every k of ``ks`` (ascending; default ``horizons()``) the k-step residual
        (B, 1, H, W): (u[i] - Phi^k(u[i-k])) / (k dt) on rows i >= k, columns >= 1; else 0.

        Rows march independently, so Phi^k(u[j]) continues Phi^k'(u[j]) for k' < k: one march
        of max(ks) steps serves every k (the longer residuals take the source rows they need
        and step on), where separate marches cost sum(ks) steps -- for k = 1, 2, ..., 128 that
        is 128 steps instead of 255, and half the autograd graph. The operations per row are
        those of the separate marches, so the residuals are bit for bit theirs (the gradient
        sums the same contributions in another order: equal to rounding).
        """
        ks = ks or self.horizons()
        assert list(ks) == sorted(ks) and ks[0] >= 1, ks
        h, dt = self.grid[0], self.spacing[0]
        out, v, done = [], u, 0          # v: Phi^done of the source rows 0 .. H - 1 - done
        for k in ks:
            v = v[..., :h - k, :]        # the sources of rows k .. H - 1
            for _ in range(k - done):
                v = self.step(v)
            done = k
            r = torch.zeros_like(u)
            r[..., k:, 1:] = ((u[..., k:, :] - v) / (k * dt))[..., 1:]
            out.append(r)
        return out

    # -- on a split block ---------------------------------------------------------------------
    def fv_halo_width(self) -> int:
        """Halo layers the k-step residuals read on a split block (the longest horizon)."""
        return _STEP_WIDTH[self.scheme] * max(self.horizons())

    def check_fv_block(self, block) -> None:
        check_halo_width(block, self.fv_halo_width(),
                         f"scheme={self.scheme!r} with horizon {self.horizon} "
                         f"(k steps read {_STEP_WIDTH[self.scheme]}k cells per side)")

    def _fv_residuals_part(self, u: torch.Tensor, ks=None) -> list[torch.Tensor]:
        """This block's part (B, 1, h, w) of the k-step residual of ``_fv_residuals`` for
        every k of ``ks`` (default ``horizons()``)."""
        blk = self.block
        ks = ks or self.horizons()
        big = max(ks)
        m = _STEP_WIDTH[self.scheme] * big
        p = blk.halo(u, m, "zeros")                              # (B, 1, h + 2m, w + 2m)
        (r0, c0), (h, w) = blk.start, blk.shape
        # One march serves every k, as in _fv_residuals: the source rows i - big .. i - 1 of
        # all k march together: big (h + big) row-steps against sum(ks) h ~ 2 big h, as the
        # halo check keeps h >= 2 big.
        e, a, done = p[..., m - big:m + h - 1, :], c0 - m, 0     # window from column a
        out = []
        for k in ks:
            for _ in range(k - done):
                e, a = self._step_window(e, a)
            done = k
            src = e[..., big - k:big - k + h, c0 - a:c0 - a + w]  # Phi^k of rows i - k
            r = (u - src) / (k * self.spacing[0])
            # global rows i < k have no residual (their source rows are the halo's zero
            # fill), nor column 0; a zero pad of the rest, as masks cost several multiplications
            i0, j0 = min(max(k - r0, 0), h), max(1 - c0, 0)
            out.append(F.pad(r[..., i0:, j0:], (j0, 0, i0, 0)))
        return out

    def _step_window(self, e: torch.Tensor, a: int):
        """One step of a window e of cells a, a+1, ... (global columns, possibly outside the
        grid): the stepped window (narrower by the step's reach per side) and its first column.
        """
        dt = self.spacing[0]
        e = self._ghost_states(e, a)
        w = e[..., 2:-2] - dt * self._flux_difference(e)
        if self.scheme == "muscl":
            w = self._ghost_states(w, a + 2)
            w = 0.5 * (e[..., 4:-4] + w[..., 2:-2] - dt * self._flux_difference(w))
        a += _STEP_WIDTH[self.scheme]
        if a <= 0 < a + w.shape[-1]:                                # the inflow value 0
            w = torch.cat([w[..., :-a], torch.zeros_like(w[..., :1]), w[..., 1 - a:]], dim=-1)
        return w, a

    def _ghost_states(self, e: torch.Tensor, a: int) -> torch.Tensor:
        """The window e (first column a) with the global ghost states outside the grid: 0 left
        of column 0, copies of column W - 1 right of it (what ``_fv_operator`` pads with)."""
        n, last = e.shape[-1], self.grid[1] - 1
        # slices and pads, not masks (a masked where costs several multiplications on CPU)
        if a < 0:
            e = F.pad(e[..., -a:], (-a, 0))
        if a + n - 1 > last:
            right = a + n - 1 - last
            e = torch.cat([e[..., :n - right], e[..., last - a:last - a + 1].expand(
                *e.shape[:-1], right)], dim=-1)
        return e
