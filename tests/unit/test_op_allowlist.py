"""The operator allow-list (epochmesh.program.op_allowlist) and the archive check built on it (issue 17).

Ordinary models, exported as packaging exports them, pass and load; the sparse model of
tests/fixtures/hostile.py (its export only traces, with fake tensors: it never runs here), an
archive edited to call an operator off the list, sparse layouts and unknown dtypes, and symbolic
shapes with powers or huge constants are refused with one line naming what.

The catalogue below is also how the list was made: add a model or layer to it to see which of
its operators the list refuses (then review them, see epochmesh/program/op_allowlist.py).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import json
import re
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import epochmesh.program.op_allowlist
from epochmesh.errors import ExportError, ProgramError
from epochmesh.packaging import LossWrapper, export_program
from epochmesh.program.archive import (
    TrainableProgram,
    initial_state_metadata,
    validate_program_archive,
)
from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS
from epochmesh.wire.tensors import to_safetensors
from tests.fixtures import MLP_DIR
from tests.fixtures.hostile import SPARSE_OUT_OF_RANGE
from tests.fixtures.hostile_programs import HUGE_POWER, with_shape_expression

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
BATCH_SYMBOL = "Symbol('s5', positive=True, integer=True)"

# ---------------------------------------------------------------------------------------------
# The catalogue: ordinary models and layers


@dataclass
class Case:
    model: nn.Module
    loss: Callable[..., torch.Tensor]
    num_inputs: int
    example: tuple[torch.Tensor, ...]  # inputs then targets, batch first


def load_model_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"allowlist_{path.parent.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classes(n: int = 4, features: int = 16, k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, features), torch.randint(0, k, (n,))


def tokens(vocab: int, length: int, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.randint(0, k, (4,)) if k else torch.randint(0, vocab, (4, length))
    return torch.randint(0, vocab, (4, length)), target


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(out, dim=1), y)


def many_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = F.one_hot(y, out.shape[1]).float()
    return (
        F.cross_entropy(out, y, label_smoothing=0.1)
        + F.l1_loss(out, t)
        + F.smooth_l1_loss(out, t)
        + F.huber_loss(out, t)
        + F.binary_cross_entropy_with_logits(out, t)
        + F.binary_cross_entropy(torch.sigmoid(out), t)
        + F.kl_div(F.log_softmax(out, 1), t, reduction="batchmean")
    )


def more_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = F.one_hot(y, out.shape[1]).float()
    ones = torch.ones(out.shape[0])
    return (
        F.cosine_embedding_loss(out, t, ones)
        + F.margin_ranking_loss(out[:, 0], out[:, 1], ones)
        + F.triplet_margin_loss(out, t, t.flip(1))
        + F.poisson_nll_loss(out, t)
        + F.soft_margin_loss(out, t * 2 - 1)
        + F.multilabel_soft_margin_loss(out, t)
        + F.hinge_embedding_loss(out, t * 2 - 1)
        + F.multi_margin_loss(out, y)
        + F.multilabel_margin_loss(out, torch.full_like(t, -1).long())
    )


def weighted_mse(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2 * w[:, None]).mean()


class BatchNormNet(nn.Module):  # tests/unit/test_program.py
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * self.scale


class Tied(nn.Module):  # tied weights and a no_grad region
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = tok.shape[1] ** -0.5 + torch.zeros(())
        return self.out(self.emb(tok).sum(1) * scale)


class TwoInputs(nn.Module):  # tests/unit/test_packaging.py
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


def conv_tanh() -> nn.Module:  # scripts/bench_training.py, tests/system/test_training.py
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 8),
    )


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.drop = nn.Dropout2d(0.1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.ada = nn.AdaptiveAvgPool2d((2, 2))
        self.amax = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(8 * 4 + 4 + 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, 1, 16, 16]
        h = F.silu(self.bn(self.c1(x)))
        h = F.max_pool2d(h, 2)
        h = self.drop(F.leaky_relu(self.gn(self.c2(h))))  # [b, 8, 4, 4]
        a = self.ada(h) + F.avg_pool2d(h, 2)
        u = F.elu(self.up(h))  # [b, 4, 8, 8]
        u = F.interpolate(u, scale_factor=0.5, mode="bilinear", align_corners=False)
        p = F.pad(F.interpolate(u, size=(4, 4), mode="nearest"), (1, 1, 1, 1), mode="reflect")
        pooled = [a.flatten(1), self.amax(p).flatten(1), F.hardtanh(u.mean((2, 3)))]
        return self.fc(torch.cat(pooled, 1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.gru = nn.GRU(16, 16, batch_first=True, bidirectional=True)
        self.rnn = nn.RNN(32, 8, batch_first=True)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:  # [b, 6]
        h, _ = self.lstm(self.emb(tok))
        h, _ = self.gru(h)
        h, _ = self.rnn(h)
        h = F.max_pool1d(self.conv(h.transpose(1, 2)), 1).transpose(1, 2)
        return self.fc(self.ln(F.gelu(h)).mean(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.1)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(16, 30)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:  # [b, 8]
        h = self.emb(tok)
        mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)
        a, _ = self.mha(h, h, h, attn_mask=mask)
        h = self.enc(h + a)
        q = h.view(h.shape[0], 8, 2, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
        return self.fc(F.normalize(h + y.transpose(1, 2).reshape(h.shape), dim=-1))


class TensorOps(nn.Module):
    """Shapes, indexing, creation, reductions, products, conversions, no_grad and autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.bias = nn.Parameter(torch.zeros(16))
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, 16]
        b = x.shape[0]
        h = self.fc(x)
        a, c = h.chunk(2, dim=1)
        p, q = h.split([4, 12], dim=1)
        s = torch.stack([a, c], dim=1).permute(0, 2, 1).reshape(b, -1)
        t = torch.cat([s, p, q], dim=1).view(b, 4, 8).transpose(1, 2).contiguous().flatten(1)
        idx = torch.arange(0, 32, 2, device=x.device)
        u = t[:, idx] + torch.index_select(t, 1, idx) + torch.gather(t, 1, idx.expand(b, -1))
        u = u + t[:, 1::2] + t[:, 0:1] + t[:, 3].unsqueeze(1) + t[..., None][:, :16, 0]
        z = torch.zeros(b, 16) + torch.ones(16) + torch.full((16,), 0.5)
        z = z + torch.empty(16).fill_(1.0) + torch.zeros_like(u) + x.new_zeros(16)
        z = z + torch.ones_like(u) * torch.rand_like(u) + torch.randn(16)
        u = torch.where(u > 0, u, 0.1 * u).masked_fill(u < -3, -3.0) + z
        m = torch.matmul(u.unsqueeze(1), self.w).squeeze(1)
        m = m + torch.bmm(u.unsqueeze(1), u.unsqueeze(2)).squeeze(2)
        m = torch.addmm(self.bias, m, self.w) + m @ self.w.t() + torch.mm(m, self.w)
        m = m.to(torch.float64).to(torch.float32) + m.double().float() + m.type(torch.float32)
        m = m + m.sum(1, keepdim=True) + m.mean() + m.amax(1, keepdim=True) + m.amin(0)
        m = m + m.max(1).values[:, None] + m.std(1, keepdim=True) + m.var(0) + m.cumsum(1)
        m = m + m.norm(dim=1, keepdim=True) + m.clamp(-10, 10) + m.abs().sqrt()
        m = m + torch.exp(-m.abs()) + torch.log1p(m.abs()) + m.pow(2)
        m = m + F.one_hot(m.argmax(1), 16) + torch.topk(m, 2, dim=1).values.sum(1, keepdim=True)
        m = m + torch.sort(m, 1).values + m.repeat(1, 2)[:, :16] + m[:, :1].expand(-1, 16)
        m = m + torch.tril(self.w)[0] + torch.flip(m, [1]) + torch.einsum("bi,ij->bj", m, self.w)
        m = m + torch.roll(m, 1, 1) + m.unflatten(1, (4, 4)).flatten(1)
        with torch.no_grad():
            k = m.detach().abs().mean() + 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = self.fc2(m / k)
        o = o.float()
        return (
            torch.tanh(o)
            + torch.sigmoid(o)
            + F.relu(o)
            + F.gelu(o, approximate="tanh")
            + F.softplus(o)
            + F.softmax(o, 1)
            + F.hardswish(o)
            + F.mish(o)
            + F.selu(o)
            + F.relu6(o)
        )


class InPlace(nn.Module):
    """In-place activations, more tensor methods, constants made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 16),
            nn.Dropout(0.1, inplace=True),
            nn.ReLU(inplace=True),
            nn.Linear(16, 16),
            nn.SiLU(inplace=True),
            nn.LeakyReLU(inplace=True),
            nn.Linear(16, 16),
            nn.ELU(inplace=True),
            nn.Linear(16, 16),
            nn.Hardtanh(inplace=True),
            nn.Linear(16, 16),
            nn.ReLU6(inplace=True),
        )
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, 16]
        h = self.net(x)
        h = h.type_as(x) + h.view_as(x) + h.reshape_as(x) + x.new_ones(16) + x.new_full((16,), 2.0)
        h = h + torch.empty_like(h).fill_(0.0) + torch.full_like(h, 1.0) + h.clone()
        h = h + h.abs().add_(1).mul_(0.5).sqrt_() + (h * 0.1).exp_()
        first = h.unbind(1)[0]
        p, q = torch.tensor_split(h, 2, dim=1)
        h = h + first[:, None] + torch.cat([q, p], 1) + h.narrow(1, 0, 16)
        h = h + h.index_add(1, torch.arange(16), h) + h[:, None].squeeze() + h.max() + h.min()
        h = h + h.sum() + h.clamp_min(0) + h.clamp_max(1) + torch.where(h > 0, h, 0.0)
        h = h + x.long().float() + x.bool().float() + x.double().to(x.dtype)
        h = h + h.unfold(1, 4, 4).sum(2).repeat_interleave(4, dim=1)
        v, m = torch.var_mean(h, 1, keepdim=True)
        s, _ = torch.std_mean(h, 1, keepdim=True)
        h = h + v + m + s + h.any(1, keepdim=True).float() + h.all(1, keepdim=True).float()
        h = h + torch.isfinite(h).float() + torch.logical_and(h > 0, h < 1).float()
        h = h + (h.le(0) | h.ge(1) & ~h.eq(0.5)).float() + h.cumprod(1).clamp(-1, 1)
        h = h + torch.outer(h[:, 0], h[0, :]) + torch.diff(h, 1, append=h[:, :1])
        h = h + h.log_softmax(1).exp() + h.argmin(1, keepdim=True)
        h = h.masked_fill(h.isnan(), 0.0) + h.new_zeros(h.shape) + torch.ones(x.size(0), 1)
        w = torch.tensor([0.5, 2.0]).to(x.device)
        c = torch.tensor(3.0, device=x.device).to(x.device, torch.float32)
        return self.fc(h * w.repeat(8) + c + torch.as_tensor([1.0] * 16).to(x))


class MoreLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 8, mode="mean")
        self.emb = nn.Embedding(40, 8)
        self.c3 = nn.Conv3d(1, 2, 3, padding=1)
        self.bn3 = nn.BatchNorm3d(2)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.shuffle = nn.PixelShuffle(2)
        self.unshuffle = nn.PixelUnshuffle(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.unfold = nn.Unfold(2, stride=2)
        self.bil = nn.Bilinear(8, 8, 8)
        self.prelu = nn.PReLU()
        self.lrn = nn.LocalResponseNorm(2)
        self.fc = nn.Linear(8, 4)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:  # [b, 8]
        b = tok.shape[0]
        e = self.emb(tok)  # [b, 8, 8]
        h = self.bag(tok) + e.mean(1)
        v = self.bn3(self.c3(e[:, None, :, :, None].expand(-1, -1, -1, -1, 2)))
        v = F.max_pool3d(v, (2, 2, 1)) + F.avg_pool3d(v, (2, 2, 1))  # [b, 2, 4, 4, 2]
        img = self.inorm(v.permute(0, 1, 4, 2, 3).reshape(b, 4, 4, 4))
        img = self.lrn(self.up(self.shuffle(self.unshuffle(img))))  # [b, 4, 8, 8]
        img = F.pad(img, (1, 1, 1, 1), mode="replicate") + F.pad(img, (1, 1, 1, 1))
        cols = self.unfold(img)  # [b, 16, 25]
        h = h + cols.mean(2)[:, :8] + F.adaptive_max_pool1d(cols, 1)[:, :8, 0]
        h = self.bil(h, h) + F.glu(torch.cat([h, h], 1), 1) + F.logsigmoid(h) + F.hardsigmoid(h)
        h = self.prelu(h) + F.softmin(h, 1) + F.softsign(h)
        h = h + F.cosine_similarity(h, e[:, 0], 1)[:, None]
        h = h + F.pairwise_distance(h, e[:, 1])[:, None] + torch.cdist(h[:, None], e).mean(2)
        h = F.alpha_dropout(h, 0.1, True) + F.dropout1d(h[:, :, None], 0.1, True)[..., 0]
        h = h + F.hardshrink(h) + F.celu(h) + F.tanhshrink(h) + torch.erf(h)
        h = h + torch.atan2(h, h + 1) + torch.remainder(h, 2) + torch.fmod(h, 2) + h.floor()
        h = h + h.ceil() + h.round() + h.sign() + torch.minimum(h, h.flip(1))
        h = h + torch.maximum(h, h.t().t()) + h.prod(1, keepdim=True) + torch.lerp(h, h * 2, 0.5)
        h = h + torch.addcmul(h, h, h) + torch.clip(h, -1, 1) + h.rsqrt().nan_to_num()
        h = h + torch.logsumexp(h, 1, keepdim=True) + torch.linspace(0, 1, 8) + torch.eye(8)[0]
        h = h.masked_scatter(h > 1, torch.zeros_like(h)) + torch.scatter(h, 1, tok % 8, 1.0)
        h = h + h.scatter_add(1, tok % 8, h) + torch.diagonal(e, 0, 1, 2)
        h = h + torch.isnan(h).float() + torch.isinf(h).to(h.dtype) + (h != h).float()
        return self.fc(h)


def catalogue() -> dict[str, Callable[[], Case]]:
    mlp = load_model_file(MLP_DIR / "model.py")
    zen = load_model_file(ROOT / "examples" / "zen" / "model.py")
    ce = F.cross_entropy
    return {
        "mlp": lambda: Case(mlp.make_model(), ce, 1, classes()),
        "zen": lambda: Case(zen.make_model(), zen.loss_fn, 1, tokens(128, 32)),
        "batch_norm": lambda: Case(BatchNormNet(), ce, 1, classes()),
        "tied": lambda: Case(Tied(), ce, 1, tokens(20, 5, k=20)),
        "linear_mse": lambda: Case(
            nn.Linear(16, 4), F.mse_loss, 1, (torch.randn(4, 16), torch.randn(4, 4))
        ),
        "two_inputs": lambda: Case(
            TwoInputs(),
            weighted_mse,
            2,
            (torch.randn(4, 16), torch.randn(4, 2), torch.randn(4, 3), torch.rand(4)),
        ),
        "conv_tanh": lambda: Case(conv_tanh(), ce, 1, (torch.randn(4, 1, 24, 24), *classes()[1:])),
        "conv": lambda: Case(Conv(), nll, 1, (torch.randn(4, 1, 16, 16), classes()[1])),
        "recurrent": lambda: Case(Recurrent(), many_losses, 1, tokens(50, 6, k=4)),
        "attention": lambda: Case(Attention(), sequence_cross_entropy, 1, tokens(30, 8)),
        "tensor_ops": lambda: Case(TensorOps(), nll, 1, classes()),
        "in_place": lambda: Case(InPlace(), nll, 1, classes()),
        "more_layers": lambda: Case(MoreLayers(), more_losses, 1, tokens(40, 8, k=4)),
    }


CASES = catalogue()


def make(name: str) -> Case:
    torch.manual_seed(0)
    return CASES[name]()


def export(case: Case) -> bytes:
    """packaging's export (dynamic batch, torch.export.save, validated: ExportError if refused)."""
    return export_program(LossWrapper(case.model, case.loss, case.num_inputs), case.example)


def export_unchecked(case: Case) -> bytes:
    """The same export without the archive check (what a submitter skipping it would send)."""
    wrapper = LossWrapper(case.model, case.loss, case.num_inputs)
    batch = torch.export.Dim("batch", min=1)
    dynamic = (tuple({0: batch} for _ in case.example),)
    ep = torch.export.export(wrapper, case.example, dynamic_shapes=dynamic)
    ep.example_inputs = None
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def initial_state(model: nn.Module) -> bytes:
    return to_safetensors(model.state_dict(), metadata=initial_state_metadata(model))


def model_json(program: bytes) -> dict:
    zf = zipfile.ZipFile(io.BytesIO(program))
    return json.loads(zf.read(next(n for n in zf.namelist() if n.endswith("models/model.json"))))


def edit_json(program: bytes, suffix: str, change: Callable[[dict], None]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(program))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(suffix):
                doc = json.loads(data)
                change(doc)
                data = json.dumps(doc).encode()
            dst.writestr(info, data)
    return out.getvalue()


def edit_model(program: bytes, change: Callable[[dict], None]) -> bytes:
    return edit_json(program, "models/model.json", change)


def refusal(program: bytes) -> str:
    """The one-line ProgramError that validate_program_archive raises for `program`."""
    with pytest.raises(ProgramError) as e:
        validate_program_archive(program)
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def mlp() -> tuple[bytes, bytes]:
    case = make("mlp")
    return export(case), initial_state(case.model)


# ---------------------------------------------------------------------------------------------
# Ordinary models pass


@functools.cache
def exported(name: str) -> tuple[Case, bytes]:
    case = make(name)
    return case, export(case)  # ExportError when the archive check refuses it


@pytest.mark.parametrize("name", list(CASES))
def test_ordinary_models_export_pass_and_train(name: str) -> None:
    case, program = exported(name)
    validate_program_archive(program)
    prog = TrainableProgram.from_bytes(program, initial_state(case.model))
    inputs, targets = case.example[: case.num_inputs], case.example[case.num_inputs :]
    for size in (1, 3):
        loss, grads = prog.loss_and_grads([t[:size] for t in inputs], [t[:size] for t in targets])
        assert isinstance(loss, float) and set(grads) == set(prog.param_names)


def test_the_mlp_loads_and_matches_its_module(mlp: tuple[bytes, bytes]) -> None:
    program, state = mlp
    prog = TrainableProgram.from_bytes(program, state)
    reference = make("mlp").model
    x, y = classes(7)
    loss, grads = prog.loss_and_grads([x], [y])
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    assert abs(loss - float(expected.detach())) < 1e-5
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name


def expressions(obj: object) -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "expr_str":
                yield v
            yield from expressions(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from expressions(v)


def test_the_expressions_and_guards_of_normal_exports_pass() -> None:
    seen: set[str] = set()
    for name in ("mlp", "two_inputs", "attention", "more_layers"):
        model = model_json(exported(name)[1])  # validated: they pass
        seen.update(expressions(model))
        seen.update(model["guards_code"])
    assert any(re.fullmatch(r"Symbol\('s\d+', positive=True, integer=True\)", s) for s in seen)
    assert any(s.startswith("Mul(Integer(") for s in seen), seen
    assert any("L['args'][0].size()[0] ==" in s for s in seen), seen


@pytest.mark.parametrize(
    "expression",
    [
        BATCH_SYMBOL,
        f"Mul(Integer(384), {BATCH_SYMBOL})",
        f"Add({BATCH_SYMBOL}, Integer(1))",
        f"Add({BATCH_SYMBOL}, Integer(-1))",
        f"Add(FloorDiv({BATCH_SYMBOL}, Integer(2)), Integer(1))",
        f"IntTrueDiv({BATCH_SYMBOL}, Integer(2))",
        f"Max(Integer(3), {BATCH_SYMBOL})",
        f"Mul(Integer(4), Min(Integer(4), Mul(Integer(16), {BATCH_SYMBOL})))",
        f"Mul(Integer({2**62}), {BATCH_SYMBOL})",
    ],
)
def test_batch_size_expressions_pass(mlp: tuple[bytes, bytes], expression: str) -> None:
    validate_program_archive(with_shape_expression(mlp[0], expression))


# ---------------------------------------------------------------------------------------------
# Operators off the list are refused by name


SPARSE_OPERATOR = re.compile(
    r"operator aten\.(sparse_coo_tensor|_sparse_coo_tensor_with_dims_and_tensors)\.\w+ is not "
    r"allowed \(not on epochmesh's operator allow-list: sparse, nested and quantized tensors, "
    r"raw storage/stride access and file operators are refused\)"
)


def sparse_case() -> Case:
    namespace: dict = {}
    exec(compile(SPARSE_OUT_OF_RANGE, "model.py", "exec"), namespace)  # defines Net, runs nothing
    torch.manual_seed(0)
    return Case(namespace["make_model"](), F.cross_entropy, 1, classes())


def test_the_sparse_model_is_refused_naming_its_operator() -> None:
    # Exporting traces with fake tensors: the out-of-range write never happens here.
    program = export_unchecked(sparse_case())
    assert SPARSE_OPERATOR.fullmatch(refusal(program))
    with pytest.raises(ExportError) as e:
        export(sparse_case())
    assert SPARSE_OPERATOR.search(str(e.value)), str(e.value)


@pytest.mark.parametrize(
    "op",
    [
        "aten.as_strided.default",
        "aten._sparse_coo_tensor_with_dims_and_tensors.default",
        "aten.to_dense.default",
        "aten.coalesce.default",
        "aten._nested_tensor_from_mask.default",
        "aten.quantize_per_tensor.default",
        "aten.int_repr.default",
        "aten.mkldnn_linear.default",
        "aten.empty_strided.default",
        "aten.set_.source_Tensor",
        "aten.resize_.default",
        "aten._unsafe_view.default",
        "aten._local_scalar_dense.default",
        "aten.max_pool2d_with_indices_backward.default",
    ],
)
def test_an_operator_off_the_list_is_refused_by_name(mlp: tuple[bytes, bytes], op: str) -> None:
    def change(model: dict) -> None:
        model["graph_module"]["graph"]["nodes"][0]["target"] = f"torch.ops.{op}"

    assert refusal(edit_model(mlp[0], change)) == (
        f"operator {op} is not allowed (not on epochmesh's operator allow-list: sparse, nested "
        "and quantized tensors, raw storage/stride access and file operators are refused)"
    )


def test_no_grad_subgraphs_are_held_to_the_list() -> None:
    program = export(make("tied"))

    def change(model: dict) -> None:
        for node in model["graph_module"]["graph"]["nodes"]:
            for inp in node["inputs"]:
                if "as_graph" in inp["arg"]:
                    sub = inp["arg"]["as_graph"]["graph"]["nodes"]
                    sub[0]["target"] = "torch.ops.aten.as_strided.default"
                    return
        raise AssertionError("no subgraph")

    assert refusal(edit_model(program, change)).startswith(
        "operator aten.as_strided.default is not allowed"
    )


# ---------------------------------------------------------------------------------------------
# Strided tensors of plain dtypes only


def first_tensor(model: dict) -> dict:
    return next(iter(model["graph_module"]["graph"]["tensor_values"].values()))


def set_meta(key: str, value: int) -> Callable[[dict], None]:
    return lambda model: first_tensor(model).__setitem__(key, value)


def add_argument(arg: dict) -> Callable[[dict], None]:
    def change(model: dict) -> None:
        node = model["graph_module"]["graph"]["nodes"][0]
        node["inputs"].append({"name": "layout", "arg": arg, "kind": 2})

    return change


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (set_meta("layout", 1), "has layout SparseCoo (only strided tensors are accepted"),
        (set_meta("layout", 6), "has layout _mkldnn (only strided tensors are accepted"),
        # Quantized dtypes have no number in the archive schema: nothing outside it passes.
        (set_meta("dtype", 14), "has dtype 14, not a plain dtype (quantized and unknown"),
        (set_meta("dtype", 0), "has dtype 0, not a plain dtype"),
        (
            add_argument({"as_layout": 2}),
            "operator aten.linear.default is given layout SparseCsr (only strided",
        ),
        (
            add_argument({"as_scalar_type": 99}),
            "operator aten.linear.default is given dtype 99, not a plain dtype",
        ),
    ],
)
def test_only_strided_tensors_of_plain_dtypes(
    mlp: tuple[bytes, bytes], change: Callable[[dict], None], needle: str
) -> None:
    assert needle in refusal(edit_model(mlp[0], change))


def test_weights_must_be_strided_too(mlp: tuple[bytes, bytes]) -> None:
    def change(cfg: dict) -> None:
        next(iter(cfg["config"].values()))["tensor_meta"]["layout"] = 1

    edited = edit_json(mlp[0], "model_weights_config.json", change)
    assert "tensor 'model.0.weight' has layout SparseCoo" in refusal(edited)


# ---------------------------------------------------------------------------------------------
# Symbolic shapes and guards: the batch-size arithmetic only


@pytest.mark.parametrize(
    ("expression", "needle"),
    [
        (HUGE_POWER, "powers are refused (**"),
        ("Pow(Integer(9), Integer(387420489))", "powers are refused"),
        (f"PowByNatural({BATCH_SYMBOL}, Integer(99999999))", "powers are refused"),
        (f"FloatPow(ToFloat({BATCH_SYMBOL}), Integer(2))", "powers are refused"),
        ("LShift(Integer(1), Integer(4294967296))", "unknown function 'LShift'"),
        ("Integer(12345678901234567890)", "integer constants are limited to the int64 range"),
        (f"Mul(-12345678901234567890, {BATCH_SYMBOL})", "limited to the int64 range"),
        ("Add(" * 25 + "Integer(1)" + ")" * 25, "nested deeper than 20 levels"),
        ("+".join(["Integer(1)"] * 120), "longer than 1000 characters"),
        (f"Add({BATCH_SYMBOL}, ceiling(Integer(1)))", "unknown function 'ceiling'"),
        (f"Add({BATCH_SYMBOL}, oo)", "unknown name 'oo'"),
        ("Float('1e999999999', precision=53)", "unknown function 'Float'"),
    ],
)
def test_shape_expressions_beyond_the_batch_arithmetic_are_refused_fast(
    mlp: tuple[bytes, bytes], expression: str, needle: str
) -> None:
    program = with_shape_expression(mlp[0], expression)
    t0 = time.process_time()  # CPU time: the cost, not the host's load
    message = refusal(program)
    assert time.process_time() - t0 < 1.0
    assert message.startswith(f"unsupported symbolic expression {expression[:80]!r}"), message
    assert needle in message, message
    with pytest.raises(ProgramError):
        TrainableProgram.from_bytes(program, mlp[1])  # refused before torch.export.load


@pytest.mark.parametrize(
    ("guard", "needle"),
    [
        ("L['args'][0].size()[0] ** 9**9**9 == 1", "powers are refused"),
        ("L['args'][0].size()[0] == 123456789012345678901", "int64 range"),
        ("__import__('os').getpid() == 0", "only comparisons of input sizes"),
    ],
)
def test_guards_beyond_size_comparisons_are_refused(
    mlp: tuple[bytes, bytes], guard: str, needle: str
) -> None:
    def change(model: dict) -> None:
        model["guards_code"] = [guard]

    message = refusal(edit_model(mlp[0], change))
    assert message.startswith(f"unsupported guard {guard[:80]!r}"), message
    assert needle in message, message


# ---------------------------------------------------------------------------------------------
# The list itself


def test_the_list_is_clean_literal_and_sorted() -> None:
    bad = re.compile(r"sparse|quantize|as_strided|set_|resize|_unsafe|from_file|mkldnn|nested")
    assert not [op for op in ALLOWED_ATEN_OPS if bad.search(op)]
    assert not [op for op in ALLOWED_ATEN_OPS if op.endswith(".out") or "backward" in op]
    for op in ALLOWED_ATEN_OPS:  # every entry names an operator of this torch
        _, name, overload = op.split(".")
        assert getattr(getattr(torch.ops.aten, name), overload) is not None, op
    # Literal, sorted sets in the source: a torch upgrade cannot widen them.
    source = Path(epochmesh.program.op_allowlist.__file__).read_text()
    literals = [
        [e.value for e in node.elts]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Set)
    ]
    assert len(literals) == 2
    assert all(entries == sorted(entries) for entries in literals)
    assert set().union(*literals) == ALLOWED_ATEN_OPS


def test_every_entry_is_core_or_emitted_by_the_catalogue() -> None:
    emitted: set[str] = set()

    def collect(graph: dict) -> None:
        for node in graph["nodes"]:
            emitted.add(node["target"].removeprefix("torch.ops."))
            for inp in node["inputs"]:
                if "as_graph" in inp["arg"]:
                    collect(inp["arg"]["as_graph"]["graph"])

    for name in CASES:
        collect(model_json(exported(name)[1])["graph_module"]["graph"])
    not_core = {op for op in ALLOWED_ATEN_OPS if not _is_core(op)}
    assert not_core == epochmesh.program.op_allowlist._EMITTED
    assert sorted(not_core - emitted) == []


def _is_core(op: str) -> bool:
    _, name, overload = op.split(".")
    return torch.Tag.core in getattr(getattr(torch.ops.aten, name), overload).tags
