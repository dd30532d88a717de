"""WrittenPartials: the partials an engine checkpointed, handed to a call made again where they go on from what the
call read (rl_contracts/inflight.py)."""

from __future__ import annotations

from rl_contracts.inflight import InflightCall, Partial, WrittenPartials


def call(resume: list[Partial | None], train_version: int | None = None, max_staleness: int = 0) -> InflightCall:
    return InflightCall("info", "inflight/step_3", ["5/0", "5/1"], resume, train_version, max_staleness)


PROMPTS = [[1, 2], [1, 2]]


def test_a_newer_partial_of_the_same_prompt_that_goes_on_from_what_was_read_is_taken():
    written = WrittenPartials()
    written.write("inflight/step_3", "5/0", [1, 2], Partial([4, 1, 7], [-0.1] * 3, [3, 3, 4]))
    written.write("inflight/step_3", "5/1", [1, 2], Partial([6], [-0.2], [3]))
    read = Partial([4], [-0.1], [3])
    out, gained = written.newer(call([read, None]), PROMPTS)
    assert out.resume == [Partial([4, 1, 7], [-0.1] * 3, [3, 3, 4]), Partial([6], [-0.2], [3])] and gained == 3


def test_what_does_not_go_on_from_the_read_partial_or_is_shorter_or_of_another_prompt_or_step_is_left():
    written = WrittenPartials()
    read = Partial([4, 1], [-0.1, -0.1], [3, 3])
    written.write("inflight/step_3", "5/0", [1, 2], Partial([4, 2, 2], [-0.1] * 3, [3, 3, 3]))  # another branch
    written.write("inflight/step_3", "5/1", [9, 9], Partial([6, 6], [-0.2] * 2, [3, 3]))  # another prompt
    first = call([read, None])
    assert written.newer(first, PROMPTS) == (first, 0)
    written.write("inflight/step_3", "5/0", [1, 2], Partial([4], [-0.1], [3]))  # shorter than what was read
    written.write("inflight/step_4", "5/1", [1, 2], Partial([6, 6], [-0.2] * 2, [3, 3]))  # another step's
    assert written.newer(first, PROMPTS) == (first, 0)


def test_a_partial_too_stale_for_the_step_is_left_and_the_oldest_rows_are_forgotten_first():
    written = WrittenPartials(capacity=2)
    written.write("inflight/step_3", "5/0", [1, 2], Partial([4, 1], [-0.1] * 2, [1, 3]))  # its first token: version 1
    assert written.newer(call([None, None], train_version=3, max_staleness=1), PROMPTS)[1] == 0
    assert written.newer(call([None, None], train_version=3, max_staleness=2), PROMPTS)[1] == 2
    written.write("inflight/step_3", "5/1", [1, 2], Partial([6], [-0.2], [3]))
    written.write("inflight/step_3", "9/0", [1, 2], Partial([6], [-0.2], [3]))
    assert len(written) == 2 and written.newer(call([None, None]), PROMPTS)[1] == 1  # 5/0 forgotten
