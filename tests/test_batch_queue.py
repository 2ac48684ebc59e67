"""BatchQueue: concurrent callers share batches, each gets its own answer, and a failed batch fails only its callers."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tbexp.backends.batch_sampling import BatchQueue


class Echo:
    """A run_batch that answers each request with itself, slowly enough for others to queue meanwhile."""

    def __init__(self, fail_on=None):
        self.sizes: list[int] = []
        self.active = 0
        self.overlapped = False
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def __call__(self, requests):
        with self._lock:
            self.active += 1
            self.overlapped |= self.active > 1
        try:
            time.sleep(0.02)
            self.sizes.append(len(requests))
            if self.fail_on in requests:
                raise RuntimeError(f"batch with {self.fail_on}")
            return [f"answer {r}" for r in requests]
        finally:
            with self._lock:
                self.active -= 1


def test_concurrent_requests_are_batched_one_batch_at_a_time():
    echo = Echo()
    queue = BatchQueue(echo, max_batch=8)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(queue.submit, range(64)))
    assert answers == [f"answer {i}" for i in range(64)]
    assert not echo.overlapped  # one batch runs at a time
    assert max(echo.sizes) <= 8 and max(echo.sizes) > 1  # callers that arrived during a batch share the next
    assert (queue.batches, queue.requests) == (len(echo.sizes), 64)


def test_a_failed_batch_fails_its_callers_and_the_queue_goes_on():
    echo = Echo(fail_on=3)
    queue = BatchQueue(echo, max_batch=1)
    with ThreadPoolExecutor(4) as pool:
        futures = {i: pool.submit(queue.submit, i) for i in range(8)}
    with pytest.raises(RuntimeError, match="batch with 3"):
        futures[3].result()
    assert [futures[i].result() for i in range(8) if i != 3] == [f"answer {i}" for i in range(8) if i != 3]
    assert queue.submit(9) == "answer 9"
