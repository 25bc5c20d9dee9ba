"""Fine-tuning's frozen phase in the Trainer (UpdateOptions(frozen=..., frozen_updates=...), --frozen-epochs): the
body untouched, masters included, while it lasts; trained after it; a resume across it bit for bit."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec.app import RunOptions, TrainData, Trainer, UpdateOptions
from mixprec.app.config import TrainConfig
from mixprec.app.tasks.digits import DigitsCNN, load_digits_split

DIGITS = load_digits_split()


def _trainer(out_dir, frozen_updates: int, policy: str = "o2_bf16") -> Trainer:
    train_x, train_y, _, _ = DIGITS
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    train = DataLoader(TensorDataset(train_x, train_y), batch_size=64, shuffle=True, generator=torch.Generator())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return Trainer(
        model,
        optimizer,
        TrainData(train, None, torch.nn.functional.cross_entropy),
        policy,
        update=UpdateOptions(
            max_grad_norm=1.0, frozen=tuple(model.features.parameters()), frozen_updates=frozen_updates
        ),
        run=RunOptions(out_dir=out_dir, progress=False),
    )


def _body(trainer: Trainer) -> list[torch.Tensor]:
    masters = dict(zip(map(id, trainer.mp.masters.model_params), trainer.mp.masters.state(), strict=True))
    return [masters[id(p)].clone() for p in trainer.model.features.parameters() if id(p) in masters]


def test_the_body_stays_untouched_while_frozen_then_trains():
    trainer = _trainer(None, frozen_updates=3)
    body, head = _body(trainer), trainer.model.classifier.weight.detach().clone()
    assert body  # o2: the convolutions have FP32 masters
    trainer.fit(steps=3)
    assert all(torch.equal(a, b) for a, b in zip(body, _body(trainer), strict=True))  # masters and all
    assert not torch.equal(head, trainer.model.classifier.weight)
    trainer.fit(steps=5)
    assert not any(torch.equal(a, b) for a, b in zip(body, _body(trainer), strict=True))


def test_a_resume_across_the_frozen_phase_is_bit_identical(tmp_path):
    straight = _trainer(tmp_path / "straight", frozen_updates=4)
    straight.fit(steps=8)
    first = _trainer(tmp_path / "split", frozen_updates=4)
    first.fit(steps=2)
    resumed = _trainer(tmp_path / "split", frozen_updates=4)
    resumed.fit(steps=8, resume=True)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_frozen_epochs_is_checked():
    with pytest.raises(ValueError, match="frozen_epochs"):
        TrainConfig(task="vision", frozen_epochs=-1)
    with pytest.raises(ValueError, match="frozen_updates"):
        UpdateOptions(frozen_updates=-1)
