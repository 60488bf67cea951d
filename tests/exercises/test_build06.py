"""Build track 06's checks (lib.course.exercises.build06): each passes its solution, refuses the stub, and
names the mistake in at least three plausible wrong versions of its step."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lib.course.exercises.build06 as checks
from lib.mamba import MambaMixer


# --------------------------------------------------------------------------- solutions (as the track's)
def discretize(dt, A_log, B, x, *, softplus=True, A_sign=-1.0, euler=False, delta_in_b=True):
    delta = F.softplus(dt) if softplus else dt  # (B, T, D)
    A = A_sign * torch.exp(A_log) if A_sign else A_log  # (D, N)
    dA = delta.unsqueeze(-1) * A
    A_bar = 1 + dA if euler else torch.exp(dA)
    Bx = ((delta * x) if delta_in_b else x).unsqueeze(-1) * B.unsqueeze(-2)
    return A_bar, Bx


def selective_scan(x, dt, A_log, B, C, D, *, disc=discretize, skip=True, carry=True, reverse=False, read_old=False):
    A_bar, Bx = disc(dt, A_log, B, x)
    b, t_len, d = x.shape
    h = x.new_zeros(b, d, A_log.shape[1])
    ys = [None] * t_len
    for t in reversed(range(t_len)) if reverse else range(t_len):
        h_old = h
        h = (A_bar[:, t] * h if carry else 0) + Bx[:, t]
        ys[t] = ((h_old if read_old else h) * C[:, t].unsqueeze(1)).sum(-1) + (D * x[:, t] if skip else 0)
    return torch.stack(ys, dim=1)


def make_ssm(
    *,
    scan=selective_scan,
    swap_bc=False,
    dt_bias=True,
    softplus_twice=False,
    x_proj_bias=False,
    a_init="log",
    dt_init="mamba",
):
    """dt_init: "mamba" (softplus(bias) log-uniform in [dt_min, dt_max], right), "none" (nn.Linear's
    own bias), "raw" (the bias holds Δ itself, its inverse softplus forgotten)."""

    class MySelectiveSSM(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            D, N, R = cfg.d_inner, cfg.d_state, cfg.dt_rank
            self.R, self.N = R, N
            self.x_proj = nn.Linear(D, R + 2 * N, bias=x_proj_bias)
            self.dt_proj = nn.Linear(R, D, bias=True)
            lo, hi = math.log(cfg.dt_min), math.log(cfg.dt_max)
            dt = torch.exp(torch.rand(D) * (hi - lo) + lo).clamp(min=cfg.dt_init_floor)
            with torch.no_grad():
                if dt_init == "mamba":
                    self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                elif dt_init == "raw":
                    self.dt_proj.bias.copy_(dt)
            if a_init == "expand":  # one row, expanded: every row the same memory
                self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(D, N))
            else:
                A = torch.arange(1, N + 1, dtype=torch.float32).repeat(D, 1)
                self.A_log = nn.Parameter(torch.log(A) if a_init == "log" else A)
            self.D = nn.Parameter(torch.ones(D))

        def forward(self, x):
            dt, B, C = self.x_proj(x).split([self.R, self.N, self.N], dim=-1)
            if swap_bc:
                B, C = C, B
            dt = self.dt_proj(dt) if dt_bias else F.linear(dt, self.dt_proj.weight)
            if softplus_twice:
                dt = F.softplus(dt)
            return scan(x, dt, self.A_log, B, C, self.D)

    return MySelectiveSSM


def make_mixer(*, ssm=None, conv="causal", conv_silu=True, gate="silu", swap_xz=False, flat=False):
    ssm_cls = ssm or make_ssm()

    class MyMambaMixer(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            C, D, K = cfg.d_model, cfg.d_inner, cfg.d_conv
            self.in_proj = nn.Linear(C, 2 * D, bias=cfg.bias)
            self.conv1d = nn.Conv1d(D, D, K, groups=D, padding=K - 1 if conv != "same" else "same", bias=cfg.conv_bias)
            if flat:  # the official flat layout: x_proj, dt_proj, A_log, D in the mixer itself
                inner = ssm_cls(cfg)
                self.x_proj, self.dt_proj, self.A_log, self.D = inner.x_proj, inner.dt_proj, inner.A_log, inner.D
            else:
                self.ssm = ssm_cls(cfg)
            self.out_proj = nn.Linear(D, C, bias=cfg.bias)

        def forward(self, x):
            B, T, C = x.shape
            xs, z = self.in_proj(x).chunk(2, dim=-1)
            if swap_xz:
                xs, z = z, xs
            xc = self.conv1d(xs.transpose(1, 2))
            xc = {
                "causal": lambda: xc[..., :T],
                "last T": lambda: xc[..., -T:],
                "same": lambda: xc,
                "untruncated": lambda: xc,
            }[conv]().transpose(1, 2)
            if conv_silu:
                xc = F.silu(xc)
            y = self.ssm(xc)
            y = {"silu": lambda: y * F.silu(z), "none": lambda: y, "z": lambda: y * z, "silu y": lambda: F.silu(y) * z}[
                gate
            ]()
            return self.out_proj(y)

    return MyMambaMixer


SOLUTIONS = {
    "check_discretize": discretize,
    "check_selective_scan": selective_scan,
    "check_selective_ssm": make_ssm(),
    "check_mamba_mixer": make_mixer(),
}


# --------------------------------------------------------------------------- wrong versions
def discretize_without_softplus(dt, A_log, B, x):
    return discretize(dt, A_log, B, x, softplus=False)


def discretize_with_a_log(dt, A_log, B, x):
    return discretize(dt, A_log, B, x, A_sign=0)


def discretize_positive_a(dt, A_log, B, x):
    return discretize(dt, A_log, B, x, A_sign=1.0)


def discretize_euler(dt, A_log, B, x):
    return discretize(dt, A_log, B, x, euler=True)


def discretize_without_delta_in_b(dt, A_log, B, x):
    return discretize(dt, A_log, B, x, delta_in_b=False)


def discretize_b_bar_only(dt, A_log, B, x):
    delta = F.softplus(dt)
    return torch.exp(delta.unsqueeze(-1) * -torch.exp(A_log)), delta.unsqueeze(-1) * B.unsqueeze(-2)


def discretize_flat_b(dt, A_log, B, x):
    A_bar, _ = discretize(dt, A_log, B, x)
    return A_bar, F.softplus(dt) * x  # (B, T, D): the outer product with B forgotten


def scan_without_skip(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, skip=False)


def scan_without_carry(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, carry=False)


def scan_backwards(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, reverse=True)


def scan_reading_old_state(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, read_old=True)


def scan_with_a_log(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, disc=discretize_with_a_log)


def scan_without_softplus(x, dt, A_log, B, C, D):
    return selective_scan(x, dt, A_log, B, C, D, disc=discretize_without_softplus)


WRONG_VERSIONS = {
    "check_discretize": [
        (discretize_without_softplus, "softplus(dt)"),
        (discretize_with_a_log, "A = -exp(A_log)"),
        (discretize_positive_a, "lost its sign"),
        (discretize_euler, "Euler"),
        (discretize_without_delta_in_b, "B̄x misses Δ"),
        (discretize_b_bar_only, "without the input"),
        (discretize_flat_b, "(B, T, D, N)"),
    ],
    "check_selective_scan": [
        (scan_without_skip, "skip is missing"),
        (scan_without_carry, "not carried"),
        (scan_backwards, "ran backwards"),
        (scan_reading_old_state, "previous state"),
        (scan_with_a_log, "Step 6.1"),
        (scan_without_softplus, "Step 6.1: Δ is dt itself"),
    ],
    "check_selective_ssm": [
        (make_ssm(swap_bc=True), "B and C are swapped"),
        (make_ssm(dt_bias=False), "dt_proj's bias is missing"),
        (make_ssm(softplus_twice=True), "softplus was applied twice"),
        (make_ssm(x_proj_bias=True), "x_proj has none"),
        (make_ssm(a_init="A"), "A_log holds the log"),
        (make_ssm(a_init="expand"), "expanded tensor"),
        (make_ssm(dt_init="none"), "Δ initialisation"),
        (make_ssm(dt_init="raw"), "holds Δ itself"),
        (make_ssm(scan=scan_without_skip), "Step 6.2"),
        (make_ssm(scan=scan_backwards), "Step 6.2: the scan ran backwards"),
    ],
    "check_mamba_mixer": [
        (make_mixer(conv="last T"), "not causal"),
        (make_mixer(conv="same"), "not causal"),
        (make_mixer(conv="untruncated"), "keep the first T"),
        (make_mixer(conv_silu=False), "SiLU after the convolution"),
        (make_mixer(gate="none"), "gate is missing"),
        (make_mixer(gate="z"), "lost its SiLU"),
        (make_mixer(gate="silu y"), "wrong branch"),
        (make_mixer(swap_xz=True), "x and z are swapped"),
        (make_mixer(flat=True), "self.ssm = MySelectiveSSM(cfg)"),
        (make_mixer(ssm=make_ssm(swap_bc=True)), "Step 6.3"),
        (make_mixer(ssm=make_ssm(scan=scan_without_carry)), "Step 6.2"),
        (make_mixer(ssm=make_ssm(scan=scan_with_a_log)), "Step 6.1"),
        (make_mixer(ssm=make_ssm(dt_init="none")), "Step 6.3: give dt_proj's bias"),
    ],
}


# --------------------------------------------------------------------------- what the checks rest on
def test_the_references_are_right_when_no_mistake_is_asked_for():
    """The wrong versions are recomputed by references with a flag per mistake: without flags they
    must equal lib's MambaMixer (else a diagnosis could name a mistake the learner did not make)."""
    mixer = checks._lib_module(MambaMixer, checks.config(), 1)
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        params = {k: t.detach() for k, t in mixer.state_dict().items()}
        torch.testing.assert_close(checks._mixer(params, x), mixer(x), rtol=1e-4, atol=1e-5)


def test_the_mixer_check_compares_with_hugging_face():
    """The last case of the mixer check is transformers' own MambaMixer: lib's, holding its weights,
    gives its output; and the check counts it (one more than the lib cases)."""
    hf = checks._hf_mixer(checks.config(), 2)
    if hf is None:
        pytest.skip("transformers is not installed")
    hf, ours = hf
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), checks._hf_forward(hf, x), rtol=1e-4, atol=1e-5)
    report = checks.check_mamba_mixer(SOLUTIONS["check_mamba_mixer"])
    assert report.passed and report.n_cases == 5 and "skipped" not in report.exercise


def test_the_solution_mixer_takes_lib_weights_by_name_both_ways():
    """The interface lesson 08 relies on: MyMambaMixer(cfg) holds lib's MambaMixer's parameter names,
    so a state dict moves either way, and the outputs agree."""
    cfg = checks.config()
    mine, lib_mixer = SOLUTIONS["check_mamba_mixer"](cfg), MambaMixer(cfg)
    lib_mixer.load_state_dict(mine.state_dict())
    x = torch.randn(1, 5, cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), lib_mixer(x), rtol=1e-4, atol=1e-5)


def test_a_later_step_says_when_an_earlier_step_is_still_the_stub():
    """The mixer built on an unsolved Step 6.3: the report names MySelectiveSSM and its step."""

    class MySelectiveSSM(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            raise NotImplementedError

    report = checks.check_mamba_mixer(make_mixer(ssm=MySelectiveSSM))
    assert report.problem == "not attempted yet" and "Step 6.3" in report.hint, report
    assert "MySelectiveSSM" in report.hint and "NotImplementedError" in report.hint


def test_an_instance_instead_of_the_class_is_refused_with_a_hint():
    report = checks.check_mamba_mixer(SOLUTIONS["check_mamba_mixer"](checks.config()))
    assert not report.passed and "pass the class itself" in report.hint
