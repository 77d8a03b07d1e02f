"""What every grader's test asks of a wrong implementation: the grader ran it (no "not attempted"), failed it, and
its report holds each of the phrases a learner needs to read — the problem and its likely cause."""

from dtlab.exercises import Report, check


def assert_fails_with(name: str, impl, expected: list[str], **options) -> Report:
    """Grade ``impl`` for exercise ``name`` (``options`` go to ``check``); fail unless it is reported as wrong with
    every phrase of ``expected`` in the report."""
    report = check(name, impl, quiet=True, **options)
    assert report.attempted and not report.passed, report.text()
    for words in expected:
        assert words in report.text(), f"{words!r} missing from\n{report.text()}"
    return report
