"""The cheap ``step()`` per micro-batch (windows.StepWatch): past a window's first call, in a
loop whose updates the step hooks tell, only each param group's first and last gradients are
read; what that leaves unseen is seen by the window's end."""

from __future__ import annotations

import torch


class CountedParam(torch.nn.Parameter):
    """A parameter that counts the reads of its ``.grad`` (autograd writes it from C++)."""

    reads = 0

    @property
    def grad(self):  # type: ignore[override]
        type(self).reads += 1 if self.counted else 0
        return torch.Tensor.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)

    counted = False


def _counted_params(n):
    params = [CountedParam(torch.randn(3)) for _ in range(n)]
    for p in params[1:-1]:  # the group's first and last are read at every micro-batch
        p.counted = True
    return params


def test_a_micro_batch_past_a_windows_first_reads_no_middle_gradient():
    """A ``step()`` per micro-batch read every parameter's gradient and version counter
    (0.5-1 ms at 2000 tensors). Past a window's first call, in a loop whose updates the hooks
    tell, the group's first and last gradients changed since the previous call say a backward
    pass ran: the other parameters are not read."""
    from resilient_callbacks.windows import StepWatch

    W = 4  # micro-batches per optimizer step

    params = _counted_params(8)
    opt = torch.optim.SGD(params, lr=0.1)
    state = {"params": params, "optimizer": opt}
    watch = StepWatch()
    found = []
    try:
        for i in range(1, 4 * W + 1):
            sum((p * p).sum() for p in params).backward()
            if i % W == 0:
                opt.step()
                opt.zero_grad()
            CountedParam.reads = 0
            found.append((watch.inside(state, 1) is not None, CountedParam.reads))
    finally:
        watch.release()
    # windows of W calls: the first window reads every gradient (no window seen yet);
    # later, the first call after an update reads them (its baseline), the others none
    assert [inside for inside, _ in found[W:]] == [True, True, True, False] * 3
    # from the third window (the first, begun by the hook's registration, was one call
    # shorter): the first call after an update reads every gradient (its baseline), the
    # others of the window the group's first and last only
    assert [reads for _, reads in found[2 * W :]] == [6, 0, 0, 0] * 2


def test_a_write_no_hook_saw_inside_a_window_is_noticed_by_the_windows_end():
    """A parameter written in place between two micro-batches (outside the state's
    optimizers) in a loop whose hooks tell its updates: not read on the cheap path, the write
    is seen at the first call that reads every parameter again (at the longest window's
    length), where the window is taken as ended; a save due is not held past it."""
    from resilient_callbacks.windows import StepWatch

    W = 4  # micro-batches per optimizer step

    params = _counted_params(4)
    opt = torch.optim.SGD(params, lr=0.1)
    state = {"params": params, "optimizer": opt}
    watch = StepWatch()
    found = []
    try:
        for i in range(1, 4 * W + 1):
            sum((p * p).sum() for p in params).backward()
            if i % W == 0 and i <= 2 * W:  # (no optimizer step after call 8)
                opt.step()
                opt.zero_grad()
            if i == 2 * W + 2:
                with torch.no_grad():
                    params[1].add_(1.0)
            found.append(watch.inside(state, 1) is not None)
    finally:
        watch.release()
    assert found[W : 2 * W] == [True, True, True, False]
    # 10, 11: micro-batches as far as their end gradients tell; 12 reads all: the write
    assert found[2 * W :] == [True, True, True, False, True, True, True, True]
