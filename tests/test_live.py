from dtlab import live


def test_headless_view_prints_every_n_steps_and_the_last(capsys):
    view = live.LiveView(total=5, every=2, headless=True)
    for i in range(5):
        view.update(loss=float(i))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert "loss 4.0000" in lines[-1]
    assert view.history == {"loss": [0.0, 1.0, 2.0, 3.0, 4.0]}


def test_disabled_view_records_but_prints_nothing(capsys):
    view = live.LiveView(total=2, every=1, enabled=False, headless=True)
    view.update(loss=1.0, acc=0.5)
    view.update(loss=0.5, acc=0.6)
    assert capsys.readouterr().out == ""
    assert view.history["acc"] == [0.5, 0.6]


def test_headless_detection(monkeypatch):
    monkeypatch.setenv("DTLAB_HEADLESS", "1")
    assert live.is_headless()
    monkeypatch.setenv("DTLAB_HEADLESS", "0")
    assert live.is_headless()  # pytest is no Jupyter kernel
