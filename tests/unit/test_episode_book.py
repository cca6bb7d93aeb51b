"""The executor's one book of episodes: transitions, the readiness rule and the order results go out in."""
import pytest

from mega_async.rollout.book import DONE, RUNNING, WAITING, Episode, EpisodeBook


def book_of(*heads_done: tuple) -> EpisodeBook:
    b = EpisodeBook()
    for tid, (head, done) in enumerate(heads_done):
        b.add(tid, Episode(f"item{tid}", None, None))
        b.start(tid, head)
        if done:
            b.finish(tid, {"tid": tid})
    return b


def test_a_result_newer_than_a_running_episode_waits_for_it():
    b = book_of((1, False), (2, True), (1, True))
    assert b.done == 2 and b.running == 1
    assert b.ready(1) and not b.ready(2)  # the head-2 result may not overtake the running head-1 episode
    b.finish(0, {"tid": 0})
    assert b.ready(3) and not b.any_running
    assert [tid for tid, _ in b.take(3)] == [0, 2, 1]  # oldest head first, then task id
    assert b.done == 0 and list(b) == []


def test_states_and_drops():
    b = EpisodeBook()
    b.add(0, Episode("a", None, None))
    b.add(1, Episode("b", None, None))
    assert [ep.state for _, ep in b] == [WAITING, WAITING] and not b.is_running(0)
    b.start(0, 3)
    assert b.is_running(0) and b.running == 1
    assert b.drop(0).state == RUNNING and b.running == 0  # rejected: its head no longer holds results back
    assert b.drop(1).data == "b" and b.drop(1) is None  # never admitted; a second drop finds nothing
    b.add(2, Episode("c", None, None, head=5, state=DONE, result={"x": 1}))  # restored from a snapshot
    assert b.ready(1) and b.take(1)[0][1].result == {"x": 1}


def test_a_done_episode_leaves_only_by_take():
    b = book_of((0, True))
    with pytest.raises(AssertionError):
        b.drop(0)
