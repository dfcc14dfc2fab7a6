"""Memory running out is a resource limit, not a bug and not a bad input: the CLI's boundary prints one line (what
was asked of which memory, and the settings of that stage that size what it holds), exit 2, no traceback; regen
stops on it instead of counting the request it was serving as failed."""

from __future__ import annotations

import pytest
import torch

from drafter.cli import run_command
from pipeline.errors import is_out_of_memory
from pipeline.regen.stage import _generate_isolating_failures

# torch's own message for a CUDA allocation that did not fit (as an 80 GB card gives it)
CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 1.41 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                "178.19 MiB is free. Including non-PyTorch memory, this process has 79.00 GiB memory in use.")


def impossible_allocation():
    return torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses: a real RuntimeError from torch


def test_host_and_device_out_of_memory_are_one_line_naming_the_stages_settings(capsys):
    assert run_command("extract", impossible_allocation) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("drafter extract: error: host memory ran out (tried to allocate 4,294,967,296.0 GiB)")
    assert "extract.tokens_per_batch" in err and "run the same command again" in err

    def cuda_out_of_memory():
        raise torch.OutOfMemoryError(CUDA_MESSAGE)  # the class and message torch raises on a full GPU

    assert run_command("train", cuda_out_of_memory) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "the GPU ran out of memory (tried to allocate 1.41 GiB; total capacity of 79.18 GiB of which 178.19 MiB " \
           "is free)" in err
    assert "train.micro_batch_tokens" in err and "train.online=false" in err


def test_any_other_runtime_error_is_still_a_bug_with_its_traceback(capsys):
    def broken():
        raise RuntimeError("shape mismatch")

    assert run_command("eval", broken) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err and not is_out_of_memory(RuntimeError("shape mismatch"))


class Backend:
    """A regen backend whose batch call fails as `batch_error` does; alone, a prompt [0] fails as malformed."""

    def __init__(self, batch_error):
        self.batch_error, self.calls = batch_error, []

    def generate(self, prompts, limits, seeds):
        self.calls.append(len(prompts))
        if len(prompts) > 1:
            self.batch_error()
        if prompts[0] == [0]:
            raise ValueError("a request the backend cannot take")
        return [f"answer to {prompts[0]}"]


def test_regen_stops_on_memory_running_out_instead_of_failing_the_requests_one_by_one():
    todo = [("a", None), ("b", None), ("c", None)]
    failures = {}
    backend = Backend(impossible_allocation)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        _generate_isolating_failures(backend, todo, [[1], [0], [2]], [4] * 3, [0] * 3, failures, 0)
    assert backend.calls == [3] and failures == {}  # no retry one by one, no request counted as failed

    def bad_input():
        raise ValueError("one bad request in the batch")

    backend = Backend(bad_input)  # any other batch failure: the requests are retried alone, the bad one counted
    got = _generate_isolating_failures(backend, todo, [[1], [0], [2]], [4] * 3, [0] * 3, failures, 0)
    assert got == ["answer to [1]", "answer to [2]"] and list(failures) == ["b"]
    assert failures["b"][0] == "generation_error" and backend.calls == [3, 1, 1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_out_of_memory_is_one_line(capsys):
    total = torch.cuda.get_device_properties(0).total_memory
    assert run_command("regen", lambda: torch.empty(2 * total, dtype=torch.uint8, device="cuda")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the GPU ran out of memory (tried to allocate" in err and "regen.batch_size" in err
