import math

import pytest
import torch

from mixprec.app.tasks.byte_corpus import bits_per_char, lm_loss, stdlib_corpus
from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT


@pytest.fixture
def source_dir(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 5)
    return tmp_path


def test_corpus_holds_out_every_tenth_file(source_dir):
    corpus = stdlib_corpus(root=source_dir)
    sizes = [len(p.read_bytes()) for p in sorted(source_dir.glob("*.py"))]
    assert len(corpus.valid) == sizes[9] + sizes[19]
    assert len(corpus.train) == sum(sizes) - len(corpus.valid)
    assert bytes(corpus.valid[:10].tolist()) == (source_dir / "m09.py").read_bytes()[:10]


def test_max_bytes_limits_the_corpus(source_dir):
    corpus = stdlib_corpus(max_bytes=500, root=source_dir)
    assert len(corpus.train) + len(corpus.valid) == 500


def test_stdlib_is_there():
    corpus = stdlib_corpus(max_bytes=100_000)
    assert corpus.files >= 10 and len(corpus.train) > 50_000
    assert b"def " in bytes(corpus.train[:20_000].tolist())


def test_too_few_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs at least 10"):
        stdlib_corpus(root=tmp_path)


def test_batches_are_next_byte_targets(source_dir):
    corpus = stdlib_corpus(root=source_dir)
    x, y = corpus.batch("train", 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_model_shapes_tied_head_and_initial_loss():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=1, width=32, heads=2, context=16))
    assert model.lm_head.weight is model.embed.weight
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    loss = lm_loss(logits, torch.randint(0, 256, (2, 16))).item()
    assert abs(loss - math.log(256)) < 0.1  # near uniform at initialization
    assert bits_per_char(math.log(256)) == pytest.approx(8.0)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=1, width=32, heads=2, context=8))
    a = torch.randint(0, 256, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 256
    assert torch.allclose(model(a)[0, :-1], model(b)[0, :-1])
