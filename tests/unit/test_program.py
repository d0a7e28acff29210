"""TrainableProgram against the original nn.Module, and the archive checks that guard donors."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from epochmesh.errors import ProgramError
from epochmesh.export_cache import ExportCache
from epochmesh.optim import build_optimizer
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.archive import TrainableProgram, read_initial_state, validate_program_archive
from epochmesh.spec import load_spec
from epochmesh.wire.tensors import from_safetensors, to_safetensors
from tests.fixtures import MLP_DIR, make_classification, write_job, write_mlp_job

pytestmark = pytest.mark.timeout(120)

N = 300
BN_MODEL = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))  # a buffer before the parameters
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(DROP)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * self.scale


def make_model():
    return Net()
"""


def reference(src: str, seed: int) -> nn.Module:
    ns: dict = {}
    exec(compile(src, "model.py", "exec"), ns)
    torch.manual_seed(seed)
    return ns["make_model"]()


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return make_classification(N)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), N)
    return build_job(load_spec(job), cache=ExportCache.default())


@pytest.fixture(scope="module")
def bn(tmp_path_factory: pytest.TempPathFactory, data: dict[str, torch.Tensor]) -> PackedJob:
    doc = {"name": "bn", "data": {"train": "d.safetensors", "inputs": ["x"], "targets": ["y"]}}
    src = BN_MODEL.replace("DROP", "0.0")
    return build_job(load_spec(write_job(tmp_path_factory.mktemp("bn"), src, data, doc)))


def eager_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("batch", [1, 2, 3, 7, N])
def test_grads_match_the_original_module(
    mlp: PackedJob, data: dict[str, torch.Tensor], batch: int
) -> None:
    prog = TrainableProgram.from_bytes(mlp.program, mlp.initial_state, torch.device("cpu"))
    ref = reference((MLP_DIR / "model.py").read_text(), seed=0)
    x, y = data["x"][:batch], data["y"][:batch]
    loss, grads = prog.loss_and_grads([x], [y])
    ref_loss, ref_grads = eager_grads(ref, x, y)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert list(grads) == list(ref_grads) == prog.param_names
    for k, g in grads.items():
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        assert torch.allclose(g, ref_grads[k], atol=1e-6, rtol=0), k


def test_names_follow_make_model_state_dict(bn: PackedJob) -> None:
    prog = TrainableProgram.from_bytes(bn.program, bn.initial_state)
    ref = reference(BN_MODEL.replace("DROP", "0.0"), seed=0)
    assert prog.state_names == list(ref.state_dict())
    assert prog.state_names[0] == "scale"
    assert prog.param_names == [n for n, _ in ref.named_parameters()]
    assert prog.buffer_names == [
        "scale",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    for k, v in prog.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


def test_batch_norm_trains_like_the_module(bn: PackedJob, data: dict[str, torch.Tensor]) -> None:
    prog = TrainableProgram.from_bytes(bn.program, bn.initial_state)
    ref = reference(BN_MODEL.replace("DROP", "0.0"), seed=0)
    ref.train()
    spec = type(bn.spec)()
    spec.CopyFrom(bn.spec)
    spec.lr, spec.momentum = 0.05, 0.9
    opt_p = build_optimizer(spec, prog.parameters())
    opt_r = build_optimizer(spec, list(ref.parameters()))
    for step in range(8):
        idx = slice(step * 32, step * 32 + 32)
        x, y = data["x"][idx], data["y"][idx]
        _, grads = prog.loss_and_grads([x], [y])
        _, ref_grads = eager_grads(ref, x, y)
        for k in grads:
            assert torch.allclose(grads[k], ref_grads[k], atol=1e-5), (step, k)
        for p, k in zip(prog.parameters(), prog.param_names, strict=True):
            p.grad = grads[k]
        opt_p.step()
        opt_r.step()
    final = prog.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(final[k].double(), v.double(), atol=1e-5), k
    assert int(final["bn.num_batches_tracked"]) == 8


def test_loss_leaves_buffers_alone(bn: PackedJob, data: dict[str, torch.Tensor]) -> None:
    prog = TrainableProgram.from_bytes(bn.program, bn.initial_state)
    before = prog.state_dict()
    loss = prog.loss([data["x"][:50]], [data["y"][:50]])
    assert loss > 0
    after = prog.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    prog.loss_and_grads([data["x"][:50]], [data["y"][:50]])
    assert not torch.equal(prog.state_dict()["bn.running_mean"], before["bn.running_mean"])


def test_dropout_and_batch_norm_run_at_any_batch_size(
    tmp_path: Path, data: dict[str, torch.Tensor]
) -> None:
    doc = {"name": "drop", "data": {"train": "d.safetensors", "inputs": ["x"], "targets": ["y"]}}
    src = BN_MODEL.replace("DROP", "0.5")
    packed = build_job(load_spec(write_job(tmp_path, src, data, doc)))
    prog = TrainableProgram.from_bytes(packed.program, packed.initial_state)
    for b in (1, 2, 3, 7, N):
        loss, grads = prog.loss_and_grads([data["x"][:b]], [data["y"][:b]])
        assert loss == loss and all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_parameters_and_state_round_trip(mlp: PackedJob) -> None:
    prog = TrainableProgram.from_bytes(mlp.program, mlp.initial_state)
    params = prog.get_parameters()
    doubled = {k: v * 2 for k, v in params.items()}
    prog.set_parameters(doubled)
    assert all(torch.equal(prog.get_parameters()[k], doubled[k]) for k in params)
    params["0.weight"].zero_()  # copies: the program is unaffected
    assert not torch.equal(prog.get_parameters()["0.weight"], params["0.weight"])
    with pytest.raises(ValueError, match="missing"):
        prog.set_parameters({"0.weight": doubled["0.weight"]})
    bad = dict(doubled)
    bad["0.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="the program expects"):
        prog.set_parameters(bad)
    other = TrainableProgram.from_bytes(mlp.program, to_safetensors(prog.state_dict()))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in prog.state_dict().items())


def test_initial_state_names_parameters_and_buffers(bn: PackedJob) -> None:
    init = read_initial_state(bn.initial_state)
    prog = TrainableProgram.from_bytes(bn.program, bn.initial_state)
    assert init.param_names == prog.param_names and init.aliases == {}
    assert init.buffer_names == prog.buffer_names
    assert list(init.parameters()) == prog.param_names
    bare = to_safetensors(init.state)  # e.g. a checkpoint written without metadata
    with pytest.raises(ProgramError, match="lacks"):
        read_initial_state(bare)
    assert read_initial_state(bare, require_params=False).param_names is None
    TrainableProgram.from_bytes(bn.program, bare)  # names then come from the program
    checkpoint = prog.state_bytes()
    assert read_initial_state(checkpoint).param_names == prog.param_names
    wrong = to_safetensors(init.state, metadata={"epochmesh.params": '["fc1.bias", "fc1.weight"]'})
    with pytest.raises(ProgramError, match="state_dict order"):
        read_initial_state(wrong)
    wrong = to_safetensors(init.state, metadata={"epochmesh.params": '["fc1.weight"]'})
    with pytest.raises(ProgramError, match="differ from the initial state"):
        TrainableProgram.from_bytes(bn.program, wrong)


def test_bad_batches_are_value_errors(mlp: PackedJob, data: dict[str, torch.Tensor]) -> None:
    prog = TrainableProgram.from_bytes(mlp.program, mlp.initial_state)
    with pytest.raises(ValueError, match="takes 2 tensors"):
        prog.loss_and_grads([data["x"][:4]], [])
    with pytest.raises(ValueError, match="rejected the batch"):
        prog.loss_and_grads([torch.zeros(4, 15)], [data["y"][:4]])
    with pytest.raises(ValueError, match="rejected the batch"):
        prog.loss_and_grads([data["x"][:4]], [data["y"][:3]])


def test_initial_state_must_match(mlp: PackedJob) -> None:
    state = from_safetensors(mlp.initial_state)
    state.pop("2.bias")
    with pytest.raises(ProgramError, match=r"missing \['2.bias'\]"):
        TrainableProgram.from_bytes(mlp.program, to_safetensors(state))
    state = from_safetensors(mlp.initial_state)
    state["0.weight"] = state["0.weight"].double()
    with pytest.raises(ValueError, match="float64"):
        TrainableProgram.from_bytes(mlp.program, to_safetensors(state))
    state = from_safetensors(mlp.initial_state)
    state["0.weight"][0, 0] = float("nan")
    with pytest.raises(ProgramError, match="NaN"):
        TrainableProgram.from_bytes(mlp.program, to_safetensors(state))


# ---------------------------------------------------------------------------------------------
# Archive validation: what torch.export.load would trust, the agent refuses.


def rezip(program: bytes, edit: Callable[[str, bytes], bytes | None], extra=()) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(program))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = edit(info.filename, src.read(info))
            if data is not None:
                dst.writestr(info.filename, data)
        for name, data in extra:
            dst.writestr(name, data)
    return out.getvalue()


def edit_model_json(program: bytes, change: Callable[[dict], None]) -> bytes:
    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("models/model.json"):
            model = json.loads(data)
            change(model)
            return json.dumps(model).encode()
        return data

    return rezip(program, edit)


def test_untouched_rezipped_program_still_loads(mlp: PackedJob) -> None:
    same = rezip(mlp.program, lambda n, d: d)
    validate_program_archive(same)
    TrainableProgram.from_bytes(same, mlp.initial_state)


def refuses(program: bytes, needle: str, tmp_path: Path, initial_state: bytes) -> None:
    with pytest.raises(ProgramError) as e:
        validate_program_archive(program)
    assert needle in str(e.value)
    with pytest.raises(ProgramError):
        TrainableProgram.from_bytes(program, initial_state)
    assert not (tmp_path / "pwned").exists()


def test_refuses_non_archives(mlp: PackedJob, tmp_path: Path) -> None:
    refuses(b"not a zip", "not a torch.export archive", tmp_path, mlp.initial_state)
    refuses(mlp.program[:100], "not a torch.export archive", tmp_path, mlp.initial_state)


def test_refuses_symbolic_expression_injection(mlp: PackedJob, tmp_path: Path) -> None:
    # torch.export.load hands these strings to sympy.sympify, which evaluates them.
    payload = f"__import__('os').system('touch {tmp_path}/pwned') or Symbol('s1', integer=True)"

    def change(model: dict) -> None:
        text = json.dumps(model)
        start = text.index("Symbol('s")
        end = text.index(")", start) + 1
        model.clear()
        model.update(json.loads(text[:start] + payload.replace("'", "\\u0027") + text[end:]))

    refuses(edit_model_json(mlp.program, change), "unsupported", tmp_path, mlp.initial_state)


def test_refuses_guard_code_injection(mlp: PackedJob, tmp_path: Path) -> None:
    def change(model: dict) -> None:
        model["guards_code"] = [f"__import__('os').system('touch {tmp_path}/pwned') == 0"]

    refuses(edit_model_json(mlp.program, change), "unsupported guard", tmp_path, mlp.initial_state)


def test_refuses_non_aten_targets(mlp: PackedJob, tmp_path: Path) -> None:
    def target(new: str) -> Callable[[dict], None]:
        def change(model: dict) -> None:
            model["graph_module"]["graph"]["nodes"][0]["target"] = new

        return change

    for bad, needle in [
        ("torch.os.system", "agents only run ATen operators"),
        ("builtins.eval", "agents only run ATen operators"),
        ("torch.ops.higher_order.cond", "agents only run ATen operators"),
        ("torch.ops.aten.from_file.default", "accesses files"),
        ("torch.ops.aten.no_such_op.default", "unknown operator"),
    ]:
        refuses(edit_model_json(mlp.program, target(bad)), needle, tmp_path, mlp.initial_state)


def test_refuses_pickles_native_code_and_extra_files(mlp: PackedJob, tmp_path: Path) -> None:
    root = zipfile.ZipFile(io.BytesIO(mlp.program)).namelist()[0].split("/")[0]
    for name, needle in [
        (f"{root}/data/aotinductor/model/model.so", "agents do not load"),
        (f"{root}/extra/notes.txt", "agents do not load"),
        (f"{root}/data/constants/custom_obj_0", "agents do not load"),
        (f"{root}/data/weights/model.pt", "agents do not load"),
        ("elsewhere/file", "outside its root folder"),
    ]:
        refuses(
            rezip(mlp.program, lambda n, d: d, [(name, b"x")]), needle, tmp_path, mlp.initial_state
        )

    def pickled_inputs(name: str, data: bytes) -> bytes:
        return b"\x80\x02N." if name.endswith("sample_inputs/model.pt") else data

    refuses(
        rezip(mlp.program, pickled_inputs), "pickled sample inputs", tmp_path, mlp.initial_state
    )

    def pickled_weight(name: str, data: bytes) -> bytes:
        if name.endswith("model_weights_config.json"):
            cfg = json.loads(data)
            next(iter(cfg["config"].values()))["use_pickle"] = True
            return json.dumps(cfg).encode()
        return data

    refuses(rezip(mlp.program, pickled_weight), "stored with pickle", tmp_path, mlp.initial_state)

    def huge_weight(name: str, data: bytes) -> bytes:
        if name.endswith("model_weights_config.json"):
            cfg = json.loads(data)
            next(iter(cfg["config"].values()))["tensor_meta"]["sizes"] = [{"as_int": 1 << 40}]
            return json.dumps(cfg).encode()
        return data

    refuses(rezip(mlp.program, huge_weight), "weight elements", tmp_path, mlp.initial_state)


def test_refuses_injection_through_names_and_specs(mlp: PackedJob, tmp_path: Path) -> None:
    def bad_fqn(model: dict) -> None:
        spec = model["graph_module"]["signature"]["input_specs"][0]
        spec["parameter"]["parameter_name"] = 'x"), __import__("os").system("id'

    refuses(
        edit_model_json(mlp.program, bad_fqn), "invalid signature name", tmp_path, mlp.initial_state
    )

    def bad_treespec(model: dict) -> None:
        sig = model["graph_module"]["module_call_graph"][0]["signature"]
        sig["in_spec"] = json.dumps(
            [1, {"type": "collections.defaultdict", "context": "null", "children_spec": []}]
        )

    refuses(
        edit_model_json(mlp.program, bad_treespec),
        "unsupported container",
        tmp_path,
        mlp.initial_state,
    )

    def nested_graph(model: dict) -> None:
        model["graph_module"]["graph"]["nodes"][0]["inputs"].append(
            {"name": "g", "arg": {"as_graph": {"name": "g"}}, "kind": 1}
        )

    refuses(
        edit_model_json(mlp.program, nested_graph), "nested graphs", tmp_path, mlp.initial_state
    )


def test_packaging_refuses_what_agents_would_refuse(tmp_path: Path, data: dict) -> None:
    src = """\
import torch
from torch import nn


class N(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.fc(t), lambda t: -self.fc(t), (x,))


def make_model():
    return N()
"""
    doc = {"name": "c", "data": {"train": "d.safetensors", "inputs": ["x"], "targets": ["y"]}}
    from epochmesh.errors import ExportError

    with pytest.raises(ExportError, match="would be refused by agents"):
        build_job(load_spec(write_job(tmp_path, src, data, doc)))


TIED_MODEL = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, tok):
        with torch.no_grad():  # a no_grad region becomes a checked subgraph
            scale = tok.shape[1] ** -0.5 + torch.zeros(())
        return self.out(self.emb(tok).sum(1) * scale)


def make_model():
    return Net()
"""


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = {
        "tok": torch.randint(0, 20, (64, 5), generator=g),
        "y": torch.randint(0, 20, (64,), generator=g),
    }
    doc = {"name": "tied", "data": {"train": "d.safetensors", "inputs": ["tok"], "targets": ["y"]}}
    packed = build_job(load_spec(write_job(tmp_path, TIED_MODEL, data, doc)))
    prog = TrainableProgram.from_bytes(packed.program, packed.initial_state)
    ref = reference(TIED_MODEL, seed=0)
    assert prog.state_names == ["emb.weight", "out.weight"]
    assert prog.param_names == [n for n, _ in ref.named_parameters()] == ["emb.weight"]
    spec = type(packed.spec)()
    spec.CopyFrom(packed.spec)
    spec.lr = 0.5
    opt_p = build_optimizer(spec, prog.parameters())
    opt_r = build_optimizer(spec, list(ref.parameters()))
    for step in range(4):
        idx = slice(step * 16, step * 16 + 16)
        _, grads = prog.loss_and_grads([data["tok"][idx]], [data["y"][idx]])
        ref.zero_grad()
        nn.functional.cross_entropy(ref(data["tok"][idx]), data["y"][idx]).backward()
        assert torch.allclose(grads["emb.weight"], ref.emb.weight.grad, atol=1e-6)
        prog.parameters()[0].grad = grads["emb.weight"]
        opt_p.step()
        opt_r.step()
    state = prog.state_dict()
    assert torch.equal(state["emb.weight"], state["out.weight"])
    assert torch.allclose(state["emb.weight"], ref.emb.weight, atol=1e-6)
    init = read_initial_state(packed.initial_state)
    assert init.param_names == ["emb.weight"] and init.aliases == {"out.weight": "emb.weight"}
    again = TrainableProgram.from_bytes(packed.program, prog.state_bytes())
    assert again.param_names == ["emb.weight"]
    assert torch.equal(again.state_dict()["out.weight"], state["emb.weight"])
