"""Progress lines without a terminal: the eta from this process's own speed."""

from mixprec.app import progress


def test_a_resumed_runs_eta_comes_from_its_own_speed(monkeypatch, capsys):
    # resumed at 30 of 40 updates, one update a second: the eta divided this process's time by the whole run's
    # share done (78%), "eta 0 s" where 9 s were left
    clock = iter([100.0, 101.0, 101.0, 101.0, 101.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.ProgressBar(40, "training", True, start=30)
    bar.update(31)
    assert "training 31/40 (78%) 1 s, eta 9 s" in capsys.readouterr().out
