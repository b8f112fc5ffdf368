"""The model zoo (`trillium.models`): each model's forward against its paper's equations written
out here with plain tensor ops on the module's own parameters (by name, never through its
submodules), its inductive bias on a planted task where the architecture matters, and its
loading from a job file (`examples/zoo/`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trillium.data import load_job
from trillium.job import ModelSpec
from trillium.metrics import auc
from trillium.models import DIN, DLRM, DNN, DCNv2, DeepFM, MMoE, build_model, load_model

ROOT = Path(__file__).resolve().parents[2]
B, DIM, NUM_DENSE = 5, 4, 3
TOL = {"atol": 1e-6, "rtol": 1e-6}


def lin(x: Tensor, layer: nn.Linear) -> Tensor:
    """y = x W^T + b from the layer's parameters."""
    y = x @ layer.weight.T
    return y + layer.bias if layer.bias is not None else y


def prelu(x: Tensor, layer: nn.PReLU) -> Tensor:
    return torch.where(x > 0, x, layer.weight * x)


def batch(shapes: list[tuple[int, ...]], seed: int = 1) -> tuple[Tensor, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, NUM_DENSE, generator=g), [torch.randn(B, *s, generator=g) for s in shapes]


# --- forward against the papers' equations ---------------------------------------------------


def test_dlrm_is_its_dot_interaction() -> None:
    torch.manual_seed(0)
    model = DLRM(NUM_DENSE, [DIM] * 4, bottom=[8], top=[8])
    dense, emb = batch([(DIM,), (DIM,), (3, DIM), (DIM,)])  # slot 2 a sequence: sum-pooled
    x = F.relu(lin(F.relu(lin(dense, model.bottom[0])), model.bottom[2]))
    t = [x, emb[0], emb[1], emb[2].sum(dim=1), emb[3]]
    z = [(t[i] * t[j]).sum(dim=1) for i in range(5) for j in range(i + 1, 5)]
    assert len(z) == model.num_interactions == 5 * 4 // 2  # n(n-1)/2 features, n = 4 slots + bottom
    assert model.top[0].in_features == DIM + 10
    expected = lin(F.relu(lin(torch.cat([x, torch.stack(z, dim=1)], dim=1), model.top[0])), model.top[2])
    torch.testing.assert_close(model(dense, emb), expected.squeeze(-1), **TOL)


@pytest.mark.parametrize(
    ("structure", "low_rank"), [("stacked", None), ("parallel", None), ("stacked", 2), ("parallel", 3)]
)
def test_dcnv2_is_its_cross_network(structure: str, low_rank: int | None) -> None:
    torch.manual_seed(0)
    model = DCNv2(NUM_DENSE, [DIM] * 3, cross_layers=2, structure=structure, low_rank=low_rank, hidden=[8, 6])
    dense, emb = batch([(DIM,), (2, DIM), (DIM,)])
    x0 = torch.cat([dense, emb[0], emb[1].sum(dim=1), emb[2]], dim=1)
    x = x0
    for layer in model.cross:
        if low_rank is None:
            wx = x @ layer.weight.T + layer.bias  # W_l x_l + b_l
        else:
            v_t, u = layer[0].weight, layer[1]  # (r, D) and (D, r): W = U V^T
            assert v_t.shape == (low_rank, x0.shape[1]) and layer[0].bias is None
            wx = (x @ v_t.T) @ u.weight.T + u.bias
        x = x0 * wx + x
    deep_in = x if structure == "stacked" else x0
    deep = F.relu(lin(F.relu(lin(deep_in, model.deep[0])), model.deep[2]))
    final = deep if structure == "stacked" else torch.cat([x, deep], dim=1)
    torch.testing.assert_close(model(dense, emb), lin(final, model.out).squeeze(-1), **TOL)


def test_deepfm_is_first_order_plus_pairwise_plus_deep() -> None:
    torch.manual_seed(0)
    model = DeepFM(NUM_DENSE, [DIM] * 3, hidden=[8])
    with torch.no_grad():
        model.bias.fill_(0.3)
    dense, emb = batch([(DIM,), (DIM,), (2, DIM)])
    v = [emb[0], emb[1], emb[2].sum(dim=1)]
    first = model.bias + lin(dense, model.dense_linear).squeeze(-1)
    first = first + sum((v[f] * model.slot_linear[f]).sum(dim=1) for f in range(3))
    fields = [dense @ model.dense_field.weight.T, *v]  # the dense columns: one more field
    second = sum((fields[f] * fields[g]).sum(dim=1) for f in range(4) for g in range(f + 1, 4))  # sum_{f<g} <v_f, v_g>
    deep = lin(F.relu(lin(torch.cat([dense, *v], dim=1), model.deep[0])), model.deep[2]).squeeze(-1)
    torch.testing.assert_close(model(dense, emb), first + second + deep, **TOL)


def test_din_attends_over_the_sequence_and_ignores_padding() -> None:
    torch.manual_seed(0)
    model = DIN(NUM_DENSE, [DIM, DIM, 2, DIM], sequence_slot=1, target_slot=3, attention_hidden=[6], hidden=[8])
    dense, emb = batch([(DIM,), (5, DIM), (2,), (DIM,)])
    lengths = [5, 3, 1, 4, 2]
    for i, n in enumerate(lengths):
        emb[1][i, n:] = 0  # zero padding rows after each sample's sequence
    att, top = model.attention, model.mlp
    rows = []
    for i, n in enumerate(lengths):
        t = emb[3][i]
        u = torch.zeros(DIM)
        for j in range(n):  # Eq. 3 over the real positions only
            h = emb[1][i, j]
            w = lin(prelu(lin(torch.cat([h, t, h - t, h * t]), att[0]), att[1]), att[2])
            u = u + w * h
        rows.append(torch.cat([dense[i], emb[0][i], emb[2][i], t, u]))
    expected = lin(prelu(lin(torch.stack(rows), top[0]), top[1]), top[2]).squeeze(-1)
    got = model(dense, emb)
    torch.testing.assert_close(got, expected, **TOL)
    longer = [emb[0], torch.cat([emb[1], torch.zeros(B, 3, DIM)], dim=1), emb[2], emb[3]]
    torch.testing.assert_close(model(dense, longer), got, **TOL)  # more padding changes nothing


# --- inductive bias on planted tasks --------------------------------------------------------
# Embeddings are fixed per-ID vectors, as the PS would serve them: the models see (B, dim) tensors.
# Measured over seeds 0, 1, 2 (this file's tasks and settings, 29 Nov 2026), held-out AUC:
#   pairwise:   DNN 0.840 0.839 0.851 | DLRM 0.942 0.944 0.946 | DCNv2 0.894 0.882 0.890
#   membership: DNN 0.852 0.850 0.850 | DIN 0.920 0.997 0.997
# The smallest gap is DCNv2's, 0.039; the test runs seed 0 and asks for 0.02.
SEED, MARGIN, STEPS, ROWS = 0, 0.02, 300, 20000


def fit_and_score(model: nn.Module, train, test, seed: int = SEED) -> float:
    dense, emb, y = train
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        i = torch.randint(len(y), (256,), generator=g)
        loss = F.binary_cross_entropy_with_logits(model(dense[i], [e[i] for e in emb]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return auc(test[2].numpy(), model(test[0], test[1]).numpy())


def pairwise_task(seed: int, dim: int = 16, vocab: int = 100, slots: int = 4):
    """label ~ Bernoulli(sigmoid(4 <e_a, e_b>)) for slots a, b of four; two noise dense columns."""
    g = torch.Generator().manual_seed(1000 + seed)
    tables = [torch.randn(vocab, dim, generator=g) / dim**0.25 for _ in range(slots)]

    def draw():
        emb = [t[torch.randint(vocab, (ROWS,), generator=g)] for t in tables]
        y = torch.bernoulli(torch.sigmoid(4 * (emb[0] * emb[1]).sum(dim=1)), generator=g)
        return torch.randn(ROWS, 2, generator=g), emb, y

    return draw(), draw()


def membership_task(seed: int, dim: int = 8, vocab: int = 200, max_len: int = 8):
    """label: is the target item in the sample's history (1 to max_len items, zero-padded)? Half
    the targets are drawn from the history; one other pooled slot and two dense columns are noise."""
    g = torch.Generator().manual_seed(2000 + seed)
    items, other = (torch.randn(vocab, dim, generator=g) / dim**0.25 for _ in range(2))

    def draw():
        ids = torch.randint(vocab, (ROWS, max_len), generator=g)
        lengths = torch.randint(1, max_len + 1, (ROWS,), generator=g)
        valid = torch.arange(max_len) < lengths[:, None]
        picked = ids[torch.arange(ROWS), (torch.rand(ROWS, generator=g) * lengths).long()]
        target = torch.where(torch.rand(ROWS, generator=g) < 0.5, picked, torch.randint(vocab, (ROWS,), generator=g))
        y = ((ids == target[:, None]) & valid).any(dim=1).float()
        emb = [other[torch.randint(vocab, (ROWS,), generator=g)], items[ids] * valid[..., None], items[target]]
        return torch.randn(ROWS, 2, generator=g), emb, y

    return draw(), draw()


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_dlrm_and_dcnv2_learn_a_pairwise_interaction_a_larger_mlp_does_not() -> None:
    train, test = pairwise_task(SEED)
    scores = {}
    for name, make in {
        "DNN": lambda: DNN(2, [16] * 4, hidden=[64, 32]),
        "DLRM": lambda: DLRM(2, [16] * 4, bottom=[16], top=[32]),
        "DCNv2": lambda: DCNv2(2, [16] * 4, cross_layers=2, hidden=[32]),
    }.items():
        torch.manual_seed(SEED)
        model = make()
        scores[name] = (fit_and_score(model, train, test), params(model))
    dnn_auc, dnn_params = scores.pop("DNN")
    for name, (score, n) in scores.items():
        assert n <= dnn_params, (name, n, dnn_params)
        assert score >= dnn_auc + MARGIN, (name, score, dnn_auc)


def test_din_learns_whether_the_target_is_in_the_history_a_sum_pooling_mlp_does_not() -> None:
    train, test = membership_task(SEED)
    torch.manual_seed(SEED)
    dnn = DNN(2, [8] * 3, hidden=[64, 32])
    dnn_auc = fit_and_score(dnn, train, test)
    torch.manual_seed(SEED)
    din = DIN(2, [8] * 3, sequence_slot=1, target_slot=2, attention_hidden=[36], hidden=[64, 32])
    din_auc = fit_and_score(din, train, test)
    assert params(din) <= params(dnn)
    assert din_auc >= dnn_auc + MARGIN, (din_auc, dnn_auc)


# --- loading ---------------------------------------------------------------------------------

ZOO = {
    "DLRM": {"num_dense": 2, "embedding_dims": [4, 4]},
    "DCNv2": {"num_dense": 2, "embedding_dims": [4, 3], "low_rank": 2, "structure": "parallel"},
    "DeepFM": {"num_dense": 2, "embedding_dims": [4, 4]},
    "DIN": {"num_dense": 2, "embedding_dims": [4, 4, 3], "sequence_slot": 0, "target_slot": 1},
    "DNN": {"num_dense": 2, "embedding_dims": [4]},
    "MMoE": {"num_dense": 2, "embedding_dims": [4, 3], "tasks": ["ctr", "cvr"], "features": "dcnv2"},
}


@pytest.mark.parametrize("name", ZOO)
def test_load_model_resolves_each_by_name(name: str) -> None:
    model = load_model(ModelSpec(cls=f"trillium.models:{name}", kwargs=ZOO[name]))
    assert type(model).__name__ == name
    with pytest.raises(ValueError, match=f"model 'trillium.models:{name}'.*no_such_kwarg"):
        load_model(ModelSpec(cls=f"trillium.models:{name}", kwargs={**ZOO[name], "no_such_kwarg": 1}))


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("DLRM", {"num_dense": 2, "embedding_dims": [4, 8]}, r"embedding_dims=\[4, 8\]"),
        ("DeepFM", {"num_dense": 2, "embedding_dims": [4, 8]}, r"embedding_dims=\[4, 8\]"),
        ("DCNv2", {"num_dense": 2, "embedding_dims": [4], "structure": "mixed"}, "structure"),
        ("DIN", {"num_dense": 0, "embedding_dims": [4, 4], "sequence_slot": 2, "target_slot": 0}, "sequence_slot=2"),
        ("DIN", {"num_dense": 0, "embedding_dims": [4, 4], "sequence_slot": 0, "target_slot": -1}, "target_slot=-1"),
        (
            "DIN",
            {"num_dense": 0, "embedding_dims": [4, 4], "sequence_slot": True, "target_slot": 0},
            "sequence_slot=True",
        ),
        ("DIN", {"num_dense": 0, "embedding_dims": [4, 8], "sequence_slot": 0, "target_slot": 1}, "same dim"),
    ],
)
def test_a_model_refusing_its_kwargs_is_named(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_model(ModelSpec(cls=f"trillium.models:{name}", kwargs=kwargs))
    assert f"'trillium.models:{name}'" in str(info.value)


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "zoo").glob("*.yaml")), ids=lambda p: p.stem)
def test_zoo_example_jobs_load_build_and_run(path: Path) -> None:
    job = load_job(path)
    assert job.model.cls.startswith("trillium.models:")
    assert job.model.kwargs["num_dense"] == len(job.dense)
    assert job.model.kwargs["embedding_dims"] == job.embedding_dims
    model = build_model(job)
    dense = torch.zeros(2, len(job.dense))
    out = model(dense, [torch.zeros(2, *shape) for shape in job.embedding_shapes])
    assert out.shape == (2,) and torch.isfinite(out).all()


def test_every_single_task_zoo_model_has_an_example_job() -> None:
    """The multi-task models (MMoE, ESMM, PLE) have theirs in examples/multitask (tests/unit/test_examples.py)."""
    names = {load_job(p).model.cls.split(":")[1] for p in (ROOT / "examples" / "zoo").glob("*.yaml")}
    assert names == {"DLRM", "DCNv2", "DeepFM", "DIN"}


# --- MMoE ------------------------------------------------------------------------------------


def softmax(z: Tensor) -> Tensor:
    e = torch.exp(z - z.max(dim=1, keepdim=True).values)
    return e / e.sum(dim=1, keepdim=True)


@pytest.mark.parametrize(("features", "low_rank"), [("concat", None), ("dcnv2", None), ("dcnv2", 2)])
def test_mmoe_is_its_gated_mixture_of_experts(features: str, low_rank: int | None) -> None:
    torch.manual_seed(0)
    cross = {"cross_layers": 2, "low_rank": low_rank} if features == "dcnv2" else {}
    model = MMoE(
        NUM_DENSE,
        [DIM] * 3,
        ["ctr", "cvr", "like"],
        num_experts=3,
        expert_hidden=[8, 6],
        tower_hidden=[5],
        features=features,
        **cross,
    )
    dense, emb = batch([(DIM,), (2, DIM), (DIM,)])  # slot 1 a sequence: sum-pooled
    x0 = torch.cat([dense, emb[0], emb[1].sum(dim=1), emb[2]], dim=1)
    x = x0
    if features == "dcnv2":
        assert len(model.cross) == 2
        for layer in model.cross:  # DCN-V2's Eq. 1: x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l
            if low_rank is None:
                wx = x @ layer.weight.T + layer.bias
            else:
                v_t, u = layer[0].weight, layer[1]  # W = U V^T, V^T of rank r and no bias
                assert v_t.shape == (low_rank, x0.shape[1]) and layer[0].bias is None
                wx = (x @ v_t.T) @ u.weight.T + u.bias
            x = x0 * wx + x
    else:
        assert model.cross is None
    f = [F.relu(lin(F.relu(lin(x, e[0])), e[2])) for e in model.experts]  # f_i(x), each (B, 6)
    expected = []
    for gate, tower in zip(model.gates, model.towers, strict=True):
        g = softmax(x @ gate.weight.T + gate.bias)  # g_k(x) = softmax(W_gk x + b_gk), (B, E)
        y = sum(g[:, i : i + 1] * f[i] for i in range(3))  # y_k = sum_i g_k(x)_i f_i(x)
        expected.append(lin(F.relu(lin(y, tower[0])), tower[2]))  # h_k(y_k), (B, 1)
    assert model.task_names == ["ctr", "cvr", "like"]
    torch.testing.assert_close(model(dense, emb), torch.cat(expected, dim=1), **TOL)


@pytest.mark.parametrize("tasks", [1, ["ctr"]])
def test_mmoe_of_one_task_returns_a_column(tasks) -> None:
    model = MMoE(NUM_DENSE, [DIM, DIM], tasks, num_experts=2, expert_hidden=[4], tower_hidden=[])
    dense, emb = batch([(DIM,), (3, DIM)])
    assert model(dense, emb).shape == (B, 1)  # (B, T) for any T, not squeezed to (B,)
    assert model.task_names == (["task0"] if tasks == 1 else ["ctr"])
    assert MMoE(NUM_DENSE, [DIM], 3).task_names == ["task0", "task1", "task2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tasks": 0}, "at least one task"),
        ({"tasks": []}, "at least one task"),
        ({"tasks": True}, "tasks=True"),
        ({"tasks": "ctr"}, "tasks='ctr'"),
        ({"tasks": ["ctr", 1]}, "tasks"),
        ({"tasks": ["ctr", "cvr", "ctr"]}, "unique"),
        ({"num_experts": 0}, "num_experts"),
        ({"features": "cross"}, "features"),
        ({"cross_layers": 2}, "cross_layers=2.*features: dcnv2"),
        ({"low_rank": 4}, "low_rank=4.*features: dcnv2"),
        ({"features": "dcnv2", "cross_layers": -1}, "cross_layers"),
        ({"features": "dcnv2", "low_rank": 0}, "low_rank"),
        ({"num_dense": 0, "embedding_dims": []}, "dense columns or embeddings"),
    ],
)
def test_mmoe_refuses_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    args = {"num_dense": NUM_DENSE, "embedding_dims": [DIM], "tasks": ["ctr", "cvr"], **kwargs}
    with pytest.raises(ValueError, match=f"MMoE.*{message}"):
        MMoE(**args)


# Two tasks from one latent: h, a random tanh network of the slot embeddings (standardized), and a
# direction of each task's own, u_a and u_b:
#   p_a = sigmoid(3h + 1.5 <u_a, x>)        about half positive
#   p_b = sigmoid(3h + 1.5 <u_b, x> - 2)    about 29% positive
# MMoE beat neither two single-task DNNs nor a shared-bottom MLP of as many parameters robustly on
# this task and variants of it (task b rarer or weaker, two latents; 300 steps, 3 to 10 seeds): by
# -0.004 to +0.011 AUC with every label; only with task b's labels kept on 1-2% of the rows by
# 0.009 to 0.044, varying by seed. So the test asks for each task's Bayes-optimal AUC (its planted
# probabilities' AUC on the test rows) within 0.03. Measured over seeds 0-9 (this file's STEPS and
# ROWS, 29 Nov 2026), MMoE falls short of it by 0.011-0.023 on task a and 0.010-0.020 on task b;
# task a's column scored against task b's labels falls short by 0.036-0.058, so one logit for both
# tasks would fail. The test runs seed 0 (0.014, 0.013; 0.047).
BAYES_TOL = 0.03


def shared_latent_task(seed: int, dim: int = 8, vocab: int = 100, slots: int = 4, hidden: int = 16):
    """Train and test rows (dense, embeddings, labels (ROWS, 2)) and the test rows' planted
    probabilities (ROWS, 2); two dense columns are noise."""
    g = torch.Generator().manual_seed(3000 + seed)
    tables = [torch.randn(vocab, dim, generator=g) / dim**0.25 for _ in range(slots)]
    width = dim * slots
    w1 = torch.randn(width, hidden, generator=g) / width**0.5
    w2 = torch.randn(hidden, generator=g) / hidden**0.5
    u = torch.randn(width, 2, generator=g) / width**0.5

    def draw():
        emb = [t[torch.randint(vocab, (ROWS,), generator=g)] for t in tables]
        x = torch.cat(emb, dim=1)
        h = torch.tanh(1.5 * x @ w1) @ w2
        h = (h - h.mean()) / h.std()
        p = torch.sigmoid(3 * h[:, None] + 1.5 * x @ u + torch.tensor([0.0, -2.0]))
        return (torch.randn(ROWS, 2, generator=g), emb, torch.bernoulli(p, generator=g)), p

    (train, _), (test, p) = draw(), draw()
    return train, test, p


def test_mmoe_reaches_the_bayes_auc_of_two_tasks_sharing_a_latent() -> None:
    train, test, p = shared_latent_task(SEED)
    torch.manual_seed(SEED)
    model = MMoE(2, [8] * 4, ["a", "b"], num_experts=3, expert_hidden=[32], tower_hidden=[8])
    dense, emb, y = train
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        i = torch.randint(len(y), (256,), generator=g)
        out = model(dense[i], [e[i] for e in emb])
        loss = F.binary_cross_entropy_with_logits(out, y[i], reduction="none").mean(dim=0).sum()  # sum over tasks
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model(test[0], test[1]).numpy()
    labels, p = test[2].numpy(), p.numpy()
    bayes = [auc(labels[:, k], p[:, k]) for k in range(2)]
    got = [auc(labels[:, k], out[:, k]) for k in range(2)]
    assert all(got[k] >= bayes[k] - BAYES_TOL for k in range(2)), (got, bayes)
    assert auc(labels[:, 1], out[:, 0]) < bayes[1] - BAYES_TOL  # the tasks differ: one logit would not do
