"""Input, loss, output and connection layers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_layers import Reports, gradcheck, make, rand, run

from shoal.config import job_pb2
from shoal.neuralnet.layers import LayerConfigError


# -- store inputs ---------------------------------------------------------------------
def test_record_input_normalises_with_mean_and_std_values():
    layer = make('name: "data" type: kRecordInput store_conf { path: "x" shape: 4 mean_value: 127.5 std_value: 127.5 }')
    assert layer.category == "input" and layer.shape == (4,)
    data, labels = torch.tensor([[0.0, 127.5, 255.0, 51.0]]), torch.tensor([3])
    out, aux = run(layer, [], feeds={"data": (data, labels)}, full=True)
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, 1.0, -0.6]])) and aux is labels
    assert torch.equal(data, torch.tensor([[0.0, 127.5, 255.0, 51.0]]))  # the fed batch is left alone


def test_csv_input_normalises_with_mean_and_std_images():
    layer = make('name: "data" type: kCSVInput store_conf { path: "x" shape: 2 shape: 2 mean_file: "m" std_file: "s" }')
    data = torch.arange(8.0).reshape(2, 4)
    with pytest.raises(ValueError, match="mean_file is set but not loaded"):
        run(layer, [], feeds={"data": (data, None)})
    layer.mean, layer.std = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([2.0, 2.0, 4.0, 4.0])
    out, _ = run(layer, [], feeds={"data": (data, torch.tensor([0, 1]))}, full=True)
    expected = (data.numpy().reshape(2, 2, 2) - [[1, 2], [3, 4]]) / [[2, 2], [4, 4]]
    np.testing.assert_allclose(out.numpy(), expected)


def test_record_input_without_labels_and_bad_confs():
    layer = make('name: "data" type: kRecordInput store_conf { path: "x" shape: 2 has_label: false }')
    _, aux = run(layer, [], feeds={"data": (torch.zeros(1, 2), torch.tensor([1]))}, full=True)
    assert aux is None
    with pytest.raises(LayerConfigError, match="store_conf.shape is required"):
        make('type: kRecordInput store_conf { path: "x" }')
    with pytest.raises(LayerConfigError, match="std_value must not be 0"):
        make('type: kRecordInput store_conf { path: "x" shape: 1 std_value: 0 }')
    with pytest.raises(KeyError, match="no batch in ctx.feeds"):
        run(layer, [])


# -- image preprocessing ---------------------------------------------------------------
def all_crops(image: np.ndarray, size: int) -> list[np.ndarray]:
    """Every crop of a C×H×W image, mirrored or not."""
    _, h, w = image.shape
    crops = [image[:, i : i + size, j : j + size] for i in range(h - size + 1) for j in range(w - size + 1)]
    return crops + [c[:, :, ::-1] for c in crops]


def test_image_preprocess_centre_crop_at_test_and_random_crop_per_image_in_training():
    layer = make("type: kImagePreprocess rgbimage_conf { cropsize: 2 mirror: true scale: 2 }", (1, 4, 4))
    assert layer.shape == (1, 2, 2)
    x = torch.arange(32.0).reshape(2, 1, 4, 4)
    centre = run(layer, [x], phase=job_pb2.kTest)
    assert centre.tolist() == [[[[10.0, 12.0], [18.0, 20.0]]], [[[42.0, 44.0], [50.0, 52.0]]]]
    seen = set()
    for seed in range(20):
        y = run(layer, [x], seed=seed).numpy() / 2
        for image, crop in zip(x.numpy(), y):
            assert any(np.array_equal(crop, c) for c in all_crops(image, 2))
        seen.add(tuple(y[0].ravel()))
        assert np.array_equal(y, run(layer, [x], seed=seed).numpy() / 2)  # the generator decides
    assert len(seen) > 6  # positions and flips vary
    batch = run(layer, [x.repeat(16, 1, 1, 1)[:32:2]], seed=1)
    assert len({tuple(b.ravel().tolist()) for b in batch}) > 1  # each image draws its own crop


def test_image_preprocess_subtracts_the_mean_image_before_cropping():
    layer = make("type: kImagePreprocess rgbimage_conf { cropsize: 2 }", (1, 3, 3))
    layer.mean = torch.arange(9.0).reshape(1, 3, 3)
    x = torch.full((1, 1, 3, 3), 10.0)
    assert run(layer, [x], phase=job_pb2.kTest).tolist() == [[[[10.0, 9.0], [7.0, 6.0]]]]
    with pytest.raises(LayerConfigError, match="cropsize 4 does not fit"):
        make("type: kImagePreprocess rgbimage_conf { cropsize: 4 }", (1, 3, 3))


# -- dummy --------------------------------------------------------------------------------
def test_dummy_input_copy_and_output():
    source = make("type: kDummy dummy_conf { input: true shape: 3 shape: 2 }")
    assert source.category == "input" and source.shape == (2,)
    x = run(source, [], seed=1)
    assert x.shape == (3, 2) and bool(((x >= 0) & (x < 1)).all()) and torch.equal(x, run(source, [], seed=1))
    copy = make("type: kDummy", (2,))
    assert torch.equal(run(copy, [x]), x)
    sink = make("type: kDummy dummy_conf { output: true }", (2,))
    assert sink.category == "loss"
    leaf = x.clone().requires_grad_(True)
    run(sink, [leaf], seed=7).backward()
    assert bool(((leaf.grad >= 0) & (leaf.grad < 1)).all()) and leaf.grad.unique().numel() == 6  # a random gradient


# -- losses ---------------------------------------------------------------------------
def test_softmax_loss_reports_scaled_loss_and_topk_accuracy():
    layer = make("type: kSoftmaxLoss softmaxloss_conf { topk: 2 scale: 3 }", (4,), (1,))
    assert layer.category == "loss" and layer.shape == ()
    scores = torch.tensor([[1.0, 2.0, 3.0, 0.0], [5.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 9.0]], dtype=torch.float64)
    labels = torch.tensor([1, 3, 0])
    reports = Reports()
    loss = run(layer, [scores, torch.zeros(3, 1)], labels=[None, labels], report=reports)
    p = np.exp(scores.numpy()) / np.exp(scores.numpy()).sum(1, keepdims=True)
    ce = -np.log(p[np.arange(3), labels.numpy()]).mean()
    assert loss.item() == pytest.approx(3 * ce)
    assert reports["loss"] == (pytest.approx(3 * ce), 3)
    assert reports["accuracy"] == (pytest.approx(2 / 3), 3)  # rows 0 (label 1 second best) and 1 (label 3 second best)
    gradcheck(layer, [scores, torch.zeros(3, 1)], labels=[None, labels])


def test_softmax_loss_reads_labels_of_its_only_source_and_checks_topk():
    layer = make("type: kCudnnSoftmaxLoss", (3,))
    reports = Reports()
    run(layer, [torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])], labels=[torch.tensor([1, 1])], report=reports)
    assert reports["accuracy"] == (0.5, 2)
    with pytest.raises(ValueError, match="carry no labels"):
        run(layer, [torch.zeros(2, 3)])
    with pytest.raises(LayerConfigError, match=r"softmaxloss_conf.topk 4 must be in 1..3"):
        make("type: kSoftmaxLoss softmaxloss_conf { topk: 4 }", (3,), (1,))


def test_euclidean_loss_gradient_is_singas_and_report_is_singas_display():
    layer = make("type: kEuclideanLoss", (5,), (5,))
    a, b = rand(4, 5), rand(4, 5)
    reports = Reports()
    loss = run(layer, [a, b], report=reports)
    squared = ((a - b) ** 2).sum().item() / 4
    assert loss.item() == pytest.approx(0.5 * squared)
    assert reports["loss"] == (pytest.approx(squared), 4)
    leaf, target = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    run(layer, [leaf, target]).backward()
    np.testing.assert_allclose(leaf.grad.numpy(), (a - b).numpy() / 4)  # SINGA: (x − t) / B
    assert target.grad is None  # the target (usually the input image) receives no gradient
    with pytest.raises(LayerConfigError, match="differ in size"):
        make("type: kEuclideanLoss", (5,), (4,))


# -- outputs -------------------------------------------------------------------------
def test_accuracy_uses_argsort_topk_and_passes_scores_on():
    acc = make("type: kAccuracy argsort_conf { topk: 2 }", (3,), (1,))
    reports = Reports()
    scores = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.5, 0.3, 0.2]])
    out = run(acc, [scores, torch.zeros(3, 1)], labels=[None, torch.tensor([2, 1, 2])], report=reports)
    assert torch.equal(out, scores) and reports["accuracy"] == (pytest.approx(1 / 3), 3)


def test_argsort_ids_best_first_ties_to_the_higher_id():
    top = make("type: kArgSort argsort_conf { topk: 2 }", (4,))
    assert top.shape == (2,) and top.category == "output"
    scores = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.5, 0.2, 0.5, 0.5]])
    assert run(top, [scores]).tolist() == [[1.0, 2.0], [3.0, 2.0]]  # SINGA's partial_sort on (score, id) pairs


def test_csv_output_creates_then_appends(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("stale\n")
    csv = make(f'type: kCSVOutput store_conf {{ path: "{path}" }}', (2,))
    x = torch.tensor([[1.0, 2.0]])
    assert torch.equal(run(csv, [x], labels=[torch.tensor([5])]), x)
    run(csv, [torch.tensor([[3.0, 4.5]])], labels=[torch.tensor([6])])
    run(csv, [torch.tensor([[7.0, 8.0]])])
    assert path.read_text() == "5,1,2\n6,3,4.5\n7,8\n"


def test_record_output_writes_numbered_records(tmp_path):
    from shoal.data.kvfile import read_kvfile
    from shoal.data.records import decode

    path = tmp_path / "out.bin"
    for _ in range(2):  # a new layer (a new run) starts the store afresh
        rec = make(f'type: kRecordOutput store_conf {{ path: "{path}" }}', (2,))
        run(rec, [torch.tensor([[1.0, 2.0], [3.0, 4.0]])], labels=[torch.tensor([5, 6])])
        run(rec, [torch.tensor([[0.5, 0.25]])], labels=[torch.tensor([7])])
    decoded = [(key, decode(v)) for key, v in read_kvfile(path)]
    assert [(k, x.tolist(), y) for k, (x, y, _) in decoded] == [(b"0", [1.0, 2.0], 5), (b"1", [3.0, 4.0], 6), (b"2", [0.5, 0.25], 7)]


# -- connection layers ---------------------------------------------------------------
def test_concate_on_features_and_on_batches():
    a, b = rand(2, 3), rand(2, 5)
    cat1 = make("type: kConcate concate_conf { concate_dim: 1 num_concates: 2 }", (3,), (5,))
    assert cat1.shape == (8,) and cat1.category == "connection"
    la, lb = torch.tensor([1, 2]), torch.tensor([3, 4])
    out, aux = run(cat1, [a, b], labels=[la, lb], full=True)
    assert torch.equal(out, torch.cat([a, b], 1)) and aux is la
    gradcheck(cat1, [a, b])
    cat0 = make("type: kConcate concate_conf { concate_dim: 0 }", (3,), (3,))
    out, aux = run(cat0, [a, a * 2], labels=[la, lb], full=True)
    assert cat0.shape == (3,) and out.shape == (4, 3) and aux.tolist() == [1, 2, 3, 4]
    with pytest.raises(LayerConfigError, match="concate_dim 0 needs equal per-sample shapes"):
        make("type: kConcate", (3,), (5,))


def test_slices_cover_their_source():
    x, labels = rand(5, 7), torch.arange(5)
    parts = [run(make(f"type: kSlice partition_id: {i} slice_conf {{ slice_dim: 1 num_slices: 3 }}", (7,)), [x]) for i in range(3)]
    assert [p.shape[1] for p in parts] == [3, 2, 2] and torch.equal(torch.cat(parts, 1), x)
    rows = [run(make(f"type: kSlice partition_id: {i} slice_conf {{ slice_dim: 0 num_slices: 2 }}", (7,)), [x], labels=[labels], full=True) for i in range(2)]
    assert torch.equal(torch.cat([r[0] for r in rows]), x) and [r[1].tolist() for r in rows] == [[0, 1, 2], [3, 4]]
    assert make("type: kSlice partition_id: 2 slice_conf { slice_dim: 1 num_slices: 3 }", (7, 2)).shape == (2, 2)
    with pytest.raises(LayerConfigError, match="partition_id 3 must index one of slice_conf.num_slices 3"):
        make("type: kSlice partition_id: 3 slice_conf { slice_dim: 1 num_slices: 3 }", (7,))


def test_split_and_bridges_are_identities_whose_gradients_add_up():
    x = rand(2, 3).requires_grad_(True)
    split = make("type: kSplit split_conf { num_splits: 2 }", (3,))
    y = run(split, [x])
    (y * 2 + y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), 5.0, dtype=torch.float64))
    for kind in ("kBridgeSrc", "kBridgeDst"):
        assert run(make(f"type: {kind}", (3,)), [x]) is x
