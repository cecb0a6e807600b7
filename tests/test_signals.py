"""Signals and the other ways a cluster ends a job: stop in time, on every rank, and lose nothing.

The multi-process cases run real processes (torchrun, or testing.run_distributed)
with hard timeouts, so a regression fails instead of hanging CI.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from toolz import compose

import helpers
from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    early_stop,
    evaluate,
    every_epochs,
    fit,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    log_epoch,
    loop,
    make_step,
    max_steps,
    reduce_lr_on_plateau,
    run_epoch,
    save_best,
    save_checkpoint,
    testing,
)
from trainfold._src.distributed import interrupt
from trainfold._src.distributed.launch import free_port


SCRIPT = Path(__file__).resolve().parent / "scripts" / "signal_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import signal_run  # noqa: E402  (its main(argv), run by testing.run_distributed)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _kill_self_at(batch_in_epoch, signum=signal.SIGINT, *, times=1):
    """A step transformer that sends this process ``signum`` after the step that reaches ``batch_in_epoch``."""
    sent = []

    def transform(step):
        def signalling(state, batch):
            new = step(state, batch)
            if new.batch_in_epoch == batch_in_epoch and len(sent) < times:
                sent.append(new.step)
                os.kill(os.getpid(), signum)
            return new

        return signalling

    return transform


def _setup(seed=0, *, ctx=None, n=48):
    ctx = ctx or Context(accelerator=Accelerator(cpu=True))
    torch.manual_seed(seed)
    model = helpers.mlp(dropout=0.2)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(helpers.classification_data(n), batch_size=4, shuffle=True))
    return ctx, state, dl


# --- one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_a_step_boundary(signum):
    """A signal stops at the next step boundary and puts the handlers back."""
    before = signal.getsignal(signum)
    ctx, state, dl = _setup()

    stopped = run_epoch(ctx, _kill_self_at(5, signum)(make_step(ctx, helpers.ce_loss)), dl, state)

    assert (0, 5, True, f"signal {signal.Signals(signum).name}") == (
        stopped.epoch,
        stopped.batch_in_epoch,
        stopped.should_stop,
        stopped.stop.reason,
    )
    assert stopped.interrupted and not stopped.stop.finished
    ctx.close()
    assert before is signal.getsignal(signum)


def test_under_accumulation_the_stop_waits_for_the_end_of_the_group():
    """A signal after the 5th micro-batch with 2 accumulation steps: the run stops at the update after the 6th,
    so no checkpoint holds half a group's gradients."""
    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2)))
    stopped = run_epoch(ctx, _kill_self_at(5)(make_step(ctx, helpers.ce_loss)), dl, state)
    assert (6, 3, True) == (stopped.batch_in_epoch, stopped.step, stopped.should_stop)


def test_a_host_can_leave_its_signals_alone():
    """Context(signals=()): trainfold installs no handler; the host's own sees the signal."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), signals=()))
        final = run_epoch(ctx, _kill_self_at(2, signal.SIGUSR1)(make_step(ctx, helpers.ce_loss)), dl, state)
        assert [signal.SIGUSR1] == seen
        assert (1, False) == (final.epoch, final.should_stop)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_signals_are_configurable():
    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), signals=[signal.SIGUSR1]))
    stopped = run_epoch(ctx, _kill_self_at(3, signal.SIGUSR1)(make_step(ctx, helpers.ce_loss)), dl, state)
    assert (3, "signal SIGUSR1") == (stopped.batch_in_epoch, stopped.stop.reason)
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        Context(accelerator=Accelerator(cpu=True), signals=[signal.SIGKILL])


def test_a_second_ctrl_c_acts_at_once_and_the_handlers_are_put_back():
    # Alone over Python's own handler: a Context an earlier test in this worker left open still has its handlers
    # installed, and this Context's would chain to them (a signal is a request to each live Context), so what the
    # second Ctrl-C reached depended on which tests ran before (it failed twice in one full run so).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctx, state, dl = _setup()
        inner = make_step(ctx, helpers.ce_loss)

        def twice(s, b):
            new = inner(s, b)
            if new.batch_in_epoch == 3:
                signal.raise_signal(signal.SIGINT)  # a request (raised in this thread: its handler runs now)
                time.sleep(interrupt.ECHO_S + 0.2)  # a person, not the launcher's forwarded copy
                signal.raise_signal(signal.SIGINT)  # impatient: now
            return new

        with pytest.raises(KeyboardInterrupt):
            run_epoch(ctx, twice, dl, state)
        assert signal.default_int_handler is signal.getsignal(signal.SIGINT)
        ctx.close()
    finally:
        signal.signal(signal.SIGINT, outer)


@pytest.mark.parametrize("signum,gap", [(signal.SIGTERM, 0.3), (signal.SIGTERM, 0.0), (signal.SIGINT, 0.0)])
def test_a_repeated_sigterm_or_an_echoed_ctrl_c_stays_a_request(signum, gap, tmp_path):
    """SLURM signals every process of the step and torchrun forwards its own copy: the second SIGTERM (or the launcher's
    copy of a Ctrl-C) must not turn the graceful stop into a kill; the final checkpoint is written."""
    ctx, state, dl = _setup()
    inner = checkpoint_every(ctx, 100, tmp_path)(make_step(ctx, helpers.ce_loss))

    def twice(s, b):
        if s.batch_in_epoch == 3:
            os.kill(os.getpid(), signum)
            time.sleep(gap)
            os.kill(os.getpid(), signum)
        return inner(s, b)

    stopped = run_epoch(ctx, twice, dl, state)

    assert (4, f"signal {signal.Signals(signum).name}") == (stopped.batch_in_epoch, stopped.stop.reason)
    assert [f"ckpt-{4:010d}"] == [p.name for p in list_checkpoints(tmp_path)]


def test_a_signal_outside_any_call():
    """Between two calls (your own code, a tracker's flush, the wait for a background save) a signal does not kill:
    the next epoch of a loop is not started; after close() the process's own handlers decide again."""
    before = signal.getsignal(signal.SIGTERM)
    ctx, state, dl = _setup()
    ran = []

    def mine(s):  # your epoch function, after run_epoch: the signal arrives here
        ran.append(s.epoch)
        if s.epoch == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return s

    final = loop(compose(mine, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)), max_epochs=3)(state)

    assert [1] == ran
    assert (1, 0, True, "signal SIGTERM") == (final.epoch, final.batch_in_epoch, final.should_stop, final.stop.reason)
    ctx.close()
    assert before is signal.getsignal(signal.SIGTERM)


_UNHONOURED = """
import os, signal, sys, time
import torch
from accelerate import Accelerator
from trainfold import Context, TrainState, make_step, run_epoch, testing

where, deadline = sys.argv[1], float(sys.argv[2])
ctx = Context(accelerator=Accelerator(cpu=True), stop_deadline_s=deadline if deadline > 0 else None)
model = torch.nn.Linear(1, 1)
state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
(loader,) = ctx.prepare_loaders(torch.utils.data.DataLoader(testing.regression_data(8), batch_size=4))
inner = make_step(ctx, testing.mse_loss)

def hung(s, batch):  # a tracker's log that never returns, inside the epoch
    print("stuck", flush=True)
    time.sleep(600)
    return inner(s, batch)

print("ready", flush=True)
if where == "blocked":  # requested, then the main thread cannot take the signal again (a C call that never returns)
    signal.raise_signal(signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    time.sleep(600)
elif where == "outside":  # the script's own code, no epoch running: nothing will act on a stop
    time.sleep(600)
else:
    run_epoch(ctx, hung, loader, state)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "where, deadline, second",
    [("outside", 1.0, False), ("in-step", 1.0, False), ("in-step", 0, True), ("blocked", 1.0, False)],
)
def test_an_unhonoured_stop_ends_the_process(where, deadline, second):
    """A stop request that nothing acts on (no epoch running, a step hung in a tracker's log) does not keep the process
    alive: past the Context's stop_deadline_s, or at a second SIGTERM a second after the first, the signal acts as it
    would without trainfold (the process ends by SIGTERM), and the log says why; a main thread that cannot take the
    signal any more (blocked in it) still ends, with SIGTERM's exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _UNHONOURED, where, str(deadline)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert "ready" == proc.stdout.readline().strip()
        if where == "in-step":
            assert "stuck" == proc.stdout.readline().strip()
        if where != "blocked":
            proc.send_signal(signal.SIGTERM)
        if second:
            time.sleep(interrupt.ECHO_S + 0.2)  # a person or a scheduler asking again, not a launcher's echo
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=helpers.scaled(60))
    finally:
        proc.kill()

    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), err[-2000:]
    assert ("SIGTERM received again" if second else "was not acted on within") in err
    assert (where == "blocked") == ("the main thread did not take the signal" in err)


def test_with_accumulation_keeps_the_stop_settings():
    """A Context made by with_accumulation keeps the signals, the agreement round and the stop deadline it was given."""
    ctx = Context(accelerator=Accelerator(cpu=True), signals=(signal.SIGTERM,), stop_check_s=0.5, stop_deadline_s=7.0)
    other = ctx.with_accumulation(2)

    assert ((signal.SIGTERM,), 0.5, 7.0) == (other.signals, other.stop_check_s, other.stop_deadline_s)
    other.close()
    ctx.close()


def test_the_launcher_is_watched_where_torchrun_started_the_process(monkeypatch):
    """From the Context's creation to its close, where torchrun's agent started the process (the variable it sets);
    never elsewhere, nor with exit_with_launcher=False. (Its exit: test_engines, with a real launcher killed.)"""
    assert Context(accelerator=Accelerator(cpu=True)).runtime.launcher is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    ctx = Context(accelerator=Accelerator(cpu=True))
    watch = ctx.runtime.launcher
    assert watch.watching and ctx.with_accumulation(1).exit_with_launcher
    ctx.close()

    assert not watch.watching
    assert Context(accelerator=Accelerator(cpu=True), exit_with_launcher=False).runtime.launcher is None
    with pytest.raises(TypeError, match="exit_with_launcher"):
        Context(accelerator=Accelerator(cpu=True), exit_with_launcher="no")


def test_a_signal_during_a_save(tmp_path):
    """Without the save catching it, Ctrl-C would raise KeyboardInterrupt in the middle of the save."""
    ctx, state, dl = _setup()
    armed = []

    def hook(event, args):
        if armed and event == "open" and str(tmp_path) in str(args[0]):
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)

    sys.addaudithook(hook)  # cannot be removed: it acts only while armed
    armed.append(True)
    save_checkpoint(ctx, tmp_path, state)
    assert not armed and 1 == len(list_checkpoints(tmp_path))

    stopped = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    assert (1, "signal SIGINT") == (stopped.batch_in_epoch, stopped.stop.reason)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"stop_check_s": 0}, "positive, finite number of seconds"),
        ({"stop_check_s": float("inf")}, "positive, finite"),
        ({"stop_deadline_s": -1}, "'stop_deadline_s' must be a positive"),
        ({"timeout": -1}, "positive, finite"),
        ({"signals": ["TERM"]}, "must be signal numbers"),
    ],
)
def test_the_contexts_stop_settings_are_checked(kw, words):
    with pytest.raises((ValueError, TypeError), match=words):
        Context(accelerator=Accelerator(cpu=True), **kw)


def test_every_end_of_epoch_function_passes_an_interrupted_epoch_through(tmp_path):
    """Nothing ended: save_best writes nothing, reduce_lr_on_plateau and every_epochs count nothing."""
    ctx, state, dl = _setup()
    calls = []

    def epoch(wrap=lambda s: s):
        return compose(
            every_epochs(1, lambda s: calls.append(s.epoch) or s),
            reduce_lr_on_plateau("eval_loss", patience=1),
            save_best(ctx, tmp_path / "best.safetensors", "eval_loss"),
            evaluate(ctx, helpers.ce_loss, dl),
            run_epoch(ctx, wrap(make_step(ctx, helpers.ce_loss)), dl),
        )

    state = epoch()(state)
    (tmp_path / "best.safetensors").unlink()
    stopped = epoch(_kill_self_at(4))(state)

    assert [1] == calls and stopped.interrupted
    assert not (tmp_path / "best.safetensors").exists()
    assert state.extras == stopped.extras


def test_the_stop_request_is_cleared_once_honoured():
    """A host running trials in one process: a Ctrl-C in one trial does not stop the next ones."""
    ctx, state, dl = _setup()
    first = run_epoch(ctx, _kill_self_at(2)(make_step(ctx, helpers.ce_loss)), dl, state)
    assert first.should_stop

    _, fresh, _ = _setup(1, ctx=ctx)
    second = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, fresh)
    assert (1, 0, False) == (second.epoch, second.batch_in_epoch, second.should_stop)


def test_an_interrupted_epoch_stays_interrupted(tmp_path):
    """Ctrl-C mid-epoch under epoch-level checkpoints: nothing after run_epoch counts the epoch, the
    checkpoint keeps its position, and the resumed run ends where one never stopped ends, bit for bit."""

    def epoch(ctx, dl, wrap=lambda s: s, root=tmp_path / "run"):
        return compose(
            save_checkpoint(ctx, root, keep_last=2),
            log_epoch(ctx),
            early_stop("eval_loss", patience=1),
            evaluate(ctx, helpers.ce_loss, dl),
            run_epoch(ctx, wrap(make_step(ctx, helpers.ce_loss)), dl),
        )

    ctx, state, dl = _setup()
    expected = loop(epoch(ctx, dl, root=tmp_path / "expected"), max_epochs=3)(state)

    ctx, state, dl = _setup()
    state = epoch(ctx, dl)(state)  # one whole epoch, then Ctrl-C at batch 7 of the second
    stopped = loop(epoch(ctx, dl, _kill_self_at(7)), max_epochs=3)(state)
    assert (1, 7, True, False) == (stopped.epoch, stopped.batch_in_epoch, stopped.should_stop, stopped.stop.finished)
    assert [1] == [r.epoch for r in stopped.history if r.name == "eval_loss"]  # no evaluation of a partial epoch
    assert state.extras["early_stop:eval_loss"] == stopped.extras["early_stop:eval_loss"]  # no epoch counted
    assert latest_checkpoint(tmp_path / "run").name == f"ckpt-{stopped.step:010d}"

    ctx, fresh, dl = _setup(99)
    resumed = load_checkpoint(ctx, tmp_path / "run", fresh)
    assert (1, 7, False) == (resumed.epoch, resumed.batch_in_epoch, resumed.should_stop)
    final = loop(epoch(ctx, dl), max_epochs=3)(resumed)
    testing.assert_params_equal(expected, final)
    assert expected.history == final.history


def test_an_interrupted_epoch_goes_on():
    """An interrupted epoch goes on in the same process once the stop is cleared."""
    ctx, state, dl = _setup()
    expected = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl), max_epochs=2)(state)

    ctx, state, dl = _setup()
    stopped = loop(run_epoch(ctx, _kill_self_at(5)(make_step(ctx, helpers.ce_loss)), dl), max_epochs=2)(state)
    assert (0, 5) == (stopped.epoch, stopped.batch_in_epoch)
    with pytest.raises(ValueError, match="stopped in the middle of an epoch over another loader"):
        run_epoch(
            ctx,
            make_step(ctx, helpers.ce_loss),
            [(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))],
            attrs.evolve(stopped, stop=None),
        )
    final = loop(run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl), max_epochs=2)(attrs.evolve(stopped, stop=None))
    testing.assert_params_equal(expected, final)
    assert expected.history == final.history


def test_fit_interrupted_mid_epoch_resumes_to_the_same_end(tmp_path):
    kw = dict(max_epochs=3, checkpoint_dir=tmp_path, progress=False)
    ctx, state, dl = _setup()
    expected = fit(ctx, helpers.ce_loss, dl, state, eval_loader=dl, **kw)

    tmp2 = tmp_path / "interrupted"
    kw["checkpoint_dir"] = tmp2
    ctx, state, dl = _setup()
    stopped = fit(ctx, helpers.ce_loss, dl, state, eval_loader=dl, transforms=[_kill_self_at(9)], **kw)
    assert (0, 9, "signal SIGINT") == (stopped.epoch, stopped.batch_in_epoch, stopped.stop.reason)

    ctx, state, dl = _setup(99)
    final = fit(ctx, helpers.ce_loss, dl, state, eval_loader=dl, **kw)
    testing.assert_params_equal(expected, final)
    assert expected.history == final.history


def _sigterm_in_first_loss():
    """A loss function that sends this process SIGTERM at its first call (an evaluation's first batch)."""
    sent = []

    def loss_fn(model, batch):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return helpers.ce_loss(model, batch)

    return loss_fn


def test_a_signal_during_evaluation_stops_the_run_after_it():
    ctx, state, dl = _setup()
    loss_fn = _sigterm_in_first_loss()

    final = loop(
        compose(evaluate(ctx, loss_fn, dl), run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)), max_epochs=3
    )(state)
    assert (1, 0, True, "signal SIGTERM") == (final.epoch, final.batch_in_epoch, final.should_stop, final.stop.reason)
    assert [1] == [r.epoch for r in final.history if r.name == "eval_loss"]  # the evaluation finished


def test_a_signal_between_epochs_is_cleared():
    """The signal arrives in an epoch function that is not an evaluation (a tracker's flush) and loop honours it
    between epochs: honoured is cleared, so a host's next trial on the same Context is not stopped by it at once."""
    ctx, state, dl = _setup()

    def flush(state):  # a tracker's flush, during which SIGTERM arrives
        os.kill(os.getpid(), signal.SIGTERM)
        return state

    stopped = loop(compose(flush, run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)), max_epochs=3)(state)
    assert (1, "signal SIGTERM") == (stopped.epoch, stopped.stop.reason)

    _, fresh, _ = _setup(1, ctx=ctx)
    second = loop(
        compose(evaluate(ctx, helpers.ce_loss, dl), run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)), max_epochs=2
    )(fresh)
    assert (2, False, None) == (second.epoch, second.should_stop, second.stop)


def test_a_stop_during_evaluation_is_saved(tmp_path):
    """No step runs after the evaluation that saw the signal, so checkpoint_every's own save never came: at_end, composed
    after the loop, saves it (the probe lost 3 updates: the newest checkpoint was update 10 of 12)."""
    ctx, state, dl = _setup()
    loss_fn = _sigterm_in_first_loss()

    saving = checkpoint_every(ctx, 5, tmp_path)
    step = saving(make_step(ctx, helpers.ce_loss))
    final = compose(saving.at_end, loop(compose(evaluate(ctx, loss_fn, dl), run_epoch(ctx, step, dl)), max_epochs=3))(
        state
    )

    assert (12, 1, "signal SIGTERM") == (final.step, final.epoch, final.stop.reason)
    assert [f"ckpt-{n:010d}" for n in (5, 10, 12)] == [p.name for p in list_checkpoints(tmp_path)]
    ctx, fresh, dl = _setup(99)
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    assert (12, 1, 0) == (resumed.step, resumed.epoch, resumed.batch_in_epoch)
    assert "eval_loss" in resumed.metrics
    testing.assert_params_equal(final, resumed)


def test_a_finished_job_trains_nothing_again(tmp_path):
    """36 updates, a checkpoint every 5: the last periodic one is update 35, the end (36) is saved too (at_end). The
    finished job started again loads the end, trains nothing, and saves nothing: the root holds what it loaded."""

    def job(seed):
        ctx, state, dl = _setup(seed)
        if latest_checkpoint(tmp_path) is not None:
            state = load_checkpoint(ctx, tmp_path, state)
        saving = checkpoint_every(ctx, 5, tmp_path, keep_last=2)
        step = saving(make_step(ctx, helpers.ce_loss))
        return compose(
            saving.at_end, loop(compose(evaluate(ctx, helpers.ce_loss, dl), run_epoch(ctx, step, dl)), max_epochs=3)
        )(state)

    finished = job(0)
    assert [f"ckpt-{n:010d}" for n in (35, 36)] == [p.name for p in list_checkpoints(tmp_path)]
    end = (tmp_path / "ckpt-0000000036").stat().st_ino

    again = job(99)
    assert (36, 3) == (again.step, again.epoch)
    assert [f"ckpt-{n:010d}" for n in (35, 36)] == [p.name for p in list_checkpoints(tmp_path)]
    assert end == (tmp_path / "ckpt-0000000036").stat().st_ino  # not written again
    testing.assert_params_equal(finished, again)
    assert finished.history == again.history


@pytest.mark.parametrize("budget", [5, 17])
def test_a_budget_ending_mid_epoch_is_evaluated(budget, tmp_path, capsys):
    """run_clm_no_trainer's --max_train_steps: max_steps then evaluate. The budget is the run's own end, so the final model
    is evaluated (a port crashed with KeyError: 'eval_loss' when the budget ended in epoch 1, and reported epoch 1's
    eval_loss as final when it ended in epoch 2)."""
    ctx, state, dl = _setup()
    saving = checkpoint_every(ctx, 100, tmp_path)
    step = saving(max_steps(budget)(make_step(ctx, helpers.ce_loss)))
    epoch = compose(
        save_best(ctx, tmp_path / "best.safetensors", "eval_loss"),
        log_epoch(ctx),
        early_stop("eval_loss", patience=1),
        evaluate(ctx, helpers.ce_loss, dl),
        run_epoch(ctx, step, dl),
    )

    final = compose(saving.at_end, loop(epoch, max_epochs=5))(state)

    assert (budget, budget // 12, budget % 12, "max_steps") == (
        final.step,
        final.epoch,
        final.batch_in_epoch,
        final.stop.reason,
    )
    ctx2, fresh, _ = _setup(99)
    expected = evaluate(ctx2, helpers.ce_loss, dl, restore_params(fresh, final))
    assert (
        pytest.approx(expected.metrics["eval_loss"], rel=1e-6) == final.metrics["eval_loss"]
    )  # the final model's (another batch order)
    assert (budget // 12, budget) == [(r.epoch, r.step) for r in final.history if r.name == "eval_loss"][-1]
    assert f"stopped in epoch {budget // 12 + 1} at update {budget} (max_steps):  eval_loss" in capsys.readouterr().out
    assert (tmp_path / "best.safetensors").exists()
    patience = final.extras.get("early_stop:eval_loss")  # counts completed epochs only: the budget's end is not one
    assert (None if budget < 12 else (final.history["eval_loss"][0], 0)) == (
        patience and (patience.best, patience.bad_epochs)
    )
    resumed = load_checkpoint(ctx2, tmp_path, fresh)  # the end, with its evaluation, is the newest checkpoint
    assert (budget, final.history) == (resumed.step, resumed.history)


def restore_params(state, source):
    with torch.no_grad():
        for p, q in zip(state.model.parameters(), source.model.parameters()):
            p.copy_(q)
    return state


def test_metrics_never_present_an_older_models_value_as_current():
    ctx, state, dl = _setup()
    train = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl)
    state = evaluate(ctx, helpers.ce_loss, dl, train(state))
    assert {"train_loss", "eval_loss"} == set(state.metrics)

    state = train(state)  # an epoch without evaluation: eval_loss is of the model 12 updates ago

    assert {"train_loss"} == set(state.metrics)
    with pytest.raises(
        KeyError,
        match=r"'eval_loss' was not recorded for the model at update 24: its last value is from update 12 \(epoch 1\)",
    ):
        state.metrics["eval_loss"]
    assert state.history.latest("eval_loss") == state.history["eval_loss"][0]


def test_a_budget_stop_ends_the_invocation_not_the_run(tmp_path):
    """max_steps(5) saves its stop; resumed with a larger budget, the run goes on to where one run of 20 ends."""

    def train(ctx, state, dl, budget, root=None):
        step = max_steps(budget)(make_step(ctx, helpers.ce_loss))
        if root is not None:
            step = checkpoint_every(ctx, 100, root)(step)
        return loop(run_epoch(ctx, step, dl), max_epochs=10)(state)

    ctx, state, dl = _setup()
    expected = train(ctx, state, dl, 20)
    assert 20 == expected.step

    ctx, state, dl = _setup()
    first = train(ctx, state, dl, 5, tmp_path)
    assert (5, 5, True, False) == (first.step, first.batch_in_epoch, first.should_stop, first.stop.finished)

    ctx, fresh, dl = _setup(99)
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    assert (5, False, None) == (resumed.step, resumed.should_stop, resumed.stop)
    testing.assert_params_equal(expected, train(ctx, resumed, dl, 20))


def test_a_finished_run_stays_finished_when_resumed(tmp_path):
    ctx, state, dl = _setup()
    epoch = compose(
        save_checkpoint(ctx, tmp_path),
        early_stop("train_loss", patience=1, min_delta=10.0),
        run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl),
    )
    done = loop(epoch, max_epochs=10)(state)
    assert (2, True, True, "early_stop:train_loss") == (
        done.epoch,
        done.should_stop,
        done.stop.finished,
        done.stop.reason,
    )

    ctx, fresh, dl = _setup(99)
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    assert (True, True) == (resumed.should_stop, resumed.stop.finished)
    assert 2 == loop(epoch, max_epochs=10)(resumed).epoch


def test_keep_last_never_prunes_the_newest_finite_checkpoint(tmp_path, caplog):
    """A run whose weights go NaN keeps saving; keep_last=2 keeps the last finite checkpoint besides the newest two."""
    ctx, state, dl = _setup()

    def loss_fn(model, batch):
        loss = helpers.ce_loss(model, batch)
        return loss * float("nan") if poisoned else loss

    poisoned = False
    step = checkpoint_every(ctx, 1, tmp_path, keep_last=2)(make_step(ctx, loss_fn))
    state = run_epoch(ctx, step, dl, state, max_batches=4)
    poisoned = True
    with (
        caplog.at_level("ERROR", logger="trainfold"),
        pytest.warns(RuntimeWarning, match="train_loss is nan .*has diverged"),
    ):
        run_epoch(ctx, step, dl, state, max_batches=4)

    assert ["ckpt-0000000004", "ckpt-0000000007", "ckpt-0000000008"] == [p.name for p in list_checkpoints(tmp_path)]
    assert "ckpt-0000000005 holds non-finite weights" in caplog.text
    ctx, fresh, _ = _setup(99)
    assert torch.isfinite(load_checkpoint(ctx, tmp_path / "ckpt-0000000004", fresh).model[0].weight).all()


# --- several processes: agreement, uneven data, timeouts -------------------------------------


def _uneven_on_this_rank(kind):
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state()
    GradientState._reset_state()
    if kind == "sized":
        ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False)))
        ctx, state, dl = _setup(ctx=ctx, n=44)  # 11 batches of 4: 6 on rank 0, 5 on rank 1
    else:
        ctx = Context(accelerator=Accelerator(cpu=True), stop_check_s=0.1)
        ctx, state, _ = _setup(ctx=ctx)
        rank = ctx.accelerator.process_index

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                g = torch.Generator().manual_seed(rank)
                for _ in range(5 + rank):  # rank 1 has one more batch
                    yield torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)

        (dl,) = ctx.own_shards(
            torch.utils.data.DataLoader(Stream(), batch_size=None)
        )  # a stream per rank: its own share
    if kind == "stream":  # the short rank raises and exits; run_distributed then stops the other, as torchrun does
        run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
        return "no error"
    try:
        run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _two_runs_after_a_signal_in_the_last_round():
    """Rank 0 gets SIGINT in the epoch's last step (3 a process), a check launches the round carrying it, the epoch ends
    with that round in flight, and loop agrees the stop between epochs. Then a second run on the same Context."""
    testing.reset_accelerate_state()
    ctx = Context(
        accelerator=Accelerator(cpu=True), stop_check_s=30.0
    )  # after the first rounds, one per 30 s: none more
    ctx, state, dl = _setup(ctx=ctx, n=24)  # 6 batches: 3 a process
    step = make_step(ctx, helpers.ce_loss)
    first_step = _kill_self_at(3)(step) if ctx.accelerator.process_index == 0 else step
    first = loop(run_epoch(ctx, first_step, dl), max_epochs=2)(state)
    _, fresh, _ = _setup(1, ctx=ctx, n=24)
    second = loop(run_epoch(ctx, step, dl), max_epochs=1)(fresh)
    ctx.close()
    return (first.epoch, first.step, first.stop.reason), (second.epoch, second.step, second.should_stop)


@pytest.mark.multiprocess
def test_a_round_in_flight_is_dropped():
    """The stop was agreed (by loop, between epochs) while a round carrying the same signal was in flight: clear()
    drains and drops it, so the next run on the Context is not stopped by it after one update."""
    for first, second in testing.run_distributed(_two_runs_after_a_signal_in_the_last_round, nprocs=2, timeout=120):
        assert (1, 3, "signal SIGINT") == first
        assert (1, 3, False) == second


@pytest.mark.multiprocess
def test_uneven_batches_fail_at_the_epoch_start():
    """Processes with different numbers of batches fail on every rank at the epoch start."""
    messages = testing.run_distributed(_uneven_on_this_rank, "sized", nprocs=2, timeout=60)
    for message in messages:
        assert "different numbers of batches this epoch (rank 0: 6, rank 1: 5)" in message


@pytest.mark.multiprocess
def test_a_rank_ending_early_fails():
    """A loader of unknown length that ends early on one rank fails instead of hanging."""
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"this process's loader ended after 5 batches, but the other processes had not ended"
    ):
        testing.run_distributed(_uneven_on_this_rank, "stream", nprocs=2, timeout=60)
    assert time.monotonic() - started < helpers.scaled(40)  # a collective's timeout would be 30 min


def _hung_rank(seconds):
    import datetime

    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), timeout=datetime.timedelta(seconds=seconds)))
    inner = make_step(ctx, helpers.ce_loss)
    rank = ctx.accelerator.process_index

    def step(s, b):
        if rank == 1 and s.step == 2:
            time.sleep(seconds + 4)  # hung: the other rank's collective gives up first
        return inner(s, b)

    run_epoch(ctx, step, dl, state)  # rank 0's collective times out and raises; the error carries trainfold's note


@pytest.mark.multiprocess
def test_a_hung_rank_fails_after_the_timeout():
    """A hung rank fails the run after the Context's timeout and the error says so."""
    with pytest.raises(RuntimeError) as info:
        testing.run_distributed(_hung_rank, 2, nprocs=2, timeout=60)
    assert "Timed out" in str(info.value)
    assert "the process group's timeout (0:00:02)" in str(info.value)
    assert re.search(
        r"process 1 was last seen \d+ s ago, at update 2 \(micro-batch 2\), in forward/backward: it is the one",
        str(info.value),
    )
    assert "Context(accelerator, timeout=" in str(info.value)


def _hung_in(phase, seconds=3):
    """Process 1 hangs (sleeps past the timeout) in ``phase`` at update 3 (the evaluation and the checkpoint after it);
    process 0's next collective times out."""
    import datetime

    from trainfold import every_steps, evaluate, save_checkpoint

    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), timeout=datetime.timedelta(seconds=seconds)))
    rank = ctx.accelerator.process_index
    hang = lambda: time.sleep(seconds + 6) if rank == 1 else None  # noqa: E731
    root = os.environ["HUNG_ROOT"]
    now = {"update": 0}

    def loss_fn(model, batch):
        if now["update"] == 2 and phase == ("forward/backward" if torch.is_grad_enabled() else "evaluation"):
            hang()
        return helpers.ce_loss(model, batch)

    class Hanging(torch.utils.data.Dataset):
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            if now["update"] == 2 and phase == "data":
                hang()
            return self.data[i]

    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(Hanging(helpers.classification_data(48)), batch_size=4))
    state.optimizer.optimizer.register_step_pre_hook(
        lambda *_: hang() if now["update"] == 2 and phase == "update" else None
    )
    state.model.module.register_state_dict_pre_hook(
        lambda *_: hang() if now["update"] == 2 and phase == "checkpoint" else None
    )

    def step(s, b):
        now["update"] = s.step  # (the step of update 3, and what runs after it in that step)
        return inner(s, b)

    inner = make_step(ctx, loss_fn)
    if phase == "checkpoint":  # (each phase's machinery alone: the others' collectives would come first)
        step = every_steps(3, lambda s: save_checkpoint(ctx, root, s))(step)
    if phase == "evaluation":
        step = every_steps(3, evaluate(ctx, loss_fn, dl))(step)
    run_epoch(ctx, step, dl, state)


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase", ["data", "forward/backward", "update", "checkpoint", "evaluation"])
def test_a_hung_process_is_named_with_the_phase_it_hangs_in(phase, tmp_path, monkeypatch):
    """A process hung while waiting for its data, in its forward and backward, in its update, in a checkpoint or in an
    evaluation: the other's timed-out collective names it and the phase it is in (its last-seen line, written every
    second by its thread, says what it is doing now)."""
    monkeypatch.setenv("HUNG_ROOT", str(tmp_path))
    with pytest.raises(RuntimeError) as info:
        testing.run_distributed(_hung_in, phase, nprocs=2, timeout=90)
    assert re.search(
        rf"process 1 was last seen \d+ s ago, at update \d+ \(micro-batch \d+\), in {phase}:", str(info.value)
    ), str(info.value)[-2000:]


def _stopped_rank(seconds):
    import datetime

    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), timeout=datetime.timedelta(seconds=seconds)))
    inner = make_step(ctx, helpers.ce_loss)
    rank = ctx.accelerator.process_index

    def step(s, b):
        if rank == 1 and s.step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped whole, as a frozen node or a debugger stops it
        return inner(s, b)

    run_epoch(ctx, step, dl, state)


@pytest.mark.multiprocess
def test_a_stopped_rank_is_named():
    """SIGSTOP to one process in the middle of an epoch: the other's collective times out, and its error names the
    stopped process, the update it was last seen at and what it was doing."""
    with pytest.raises(RuntimeError) as info:
        testing.run_distributed(_stopped_rank, 2, nprocs=2, timeout=60)
    found = re.search(  # (not heard from: the timeout came more than a few heartbeats after it stopped)
        r"process 1 (?:was last seen \d+ s ago, at|has not been heard from for \d+ s \(stopped or dead\); it was last seen "
        r"at) update (\d+) \(micro-batch \d+\), in (?:data|forward/backward|update|stop agreement): it is the one",
        str(info.value),
    )
    assert found and int(found.group(1)) in (1, 2)  # its last round's line, or the one before if it stopped first
    # (in a phase of a step: what it did at its last write, up to a second before the stop)


def _one_of_three_stopped():
    import datetime

    ctx, state, dl = _setup(ctx=Context(accelerator=Accelerator(cpu=True), timeout=datetime.timedelta(seconds=8)))
    inner = make_step(ctx, helpers.ce_loss)
    rank = ctx.accelerator.process_index

    def step(s, b):
        if rank == 2 and s.step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # after its round of update 2: its line is as new as the others'
        return inner(s, b)

    run_epoch(ctx, step, dl, state)  # the others' collective times out; their errors carry trainfold's note


@pytest.mark.multiprocess
def test_a_stopped_process_of_three_is_named_by_the_others():
    """SIGSTOP to one of three processes: the two others wait in the same collective, their notes as old as its own,
    but they still write that they are there (a heartbeat from the writer thread), and it does not: it is named, and
    no other."""
    with pytest.raises(RuntimeError) as info:
        testing.run_distributed(_one_of_three_stopped, nprocs=3, timeout=90)
    said = str(info.value)
    assert re.search(r"process 2 has not been heard from for \d+ s \(stopped or dead\)", said), said
    assert not re.search(r"process [01] (was last seen|has not been heard from)", said)  # nobody else is named


def _writer_after_close():
    import threading

    ctx, state, dl = _setup()
    run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)  # agreement rounds: the writer thread started
    started = any(t.name == "trainfold-last-seen" for t in threading.enumerate())
    ctx.accelerator.wait_for_everyone()
    ctx.close()
    deadline = time.monotonic() + 10  # the thread's next wake (a heartbeat) sees the stop: waited for, not slept on
    while any(t.name == "trainfold-last-seen" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return started, any(t.name == "trainfold-last-seen" for t in threading.enumerate())


@pytest.mark.multiprocess
def test_the_last_seen_writer_ends_with_the_context():
    """Its heartbeat would otherwise write to the store for as long as the process lives, after the run is closed."""
    for started, alive in testing.run_distributed(_writer_after_close, nprocs=2, timeout=60):
        assert started and not alive


def _named_before_any_round():
    from trainfold._src.distributed.last_seen import LastSeen, who_is_missing

    ctx = Context(accelerator=Accelerator(cpu=True))
    rank = ctx.accelerator.process_index
    try:
        nobody = who_is_missing(2, rank)  # no process has written its line yet
        ctx.accelerator.wait_for_everyone()  # every process has read before process 0 writes
        if rank == 0:
            LastSeen().seen(0, 7, 3)  # (outside run_epoch: its phase is "training")
        ctx.accelerator.wait_for_everyone()
        deadline = time.monotonic() + 30  # the writer thread's line: waited for, not slept on
        while rank == 1 and "last seen" not in (who_is_missing(2, 1) or "") and time.monotonic() < deadline:
            time.sleep(0.01)
        then = who_is_missing(2, rank)
        ctx.accelerator.wait_for_everyone()  # process 1 has read before process 0's group goes
        return nobody, then
    finally:
        ctx.close()


@pytest.mark.multiprocess
def test_a_process_never_seen_is_named_first():
    """Before any round, each process names the other as never seen; once process 0 wrote its line, process 1 names
    where it was, and process 0 still names process 1 as never seen."""
    (nobody_0, then_0), (nobody_1, then_1) = testing.run_distributed(_named_before_any_round, nprocs=2, timeout=60)
    assert nobody_0.startswith("process 1 was never seen") and nobody_1.startswith("process 0 was never seen")
    assert then_0.startswith("process 1 was never seen")
    assert re.match(r"process 0 was last seen \d+ s ago, at update 3 \(micro-batch 7\), in training", then_1)


# --- signals to a real torchrun job -----------------------------------------------------------


def _torchrun(root, out, *extra):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        str(root),
        str(out),
        *extra,
    ]


def _to_end(root, out, *extra):
    """The job to its end on 2 processes of ``testing.run_distributed`` (forked with torch and Accelerate imported: the
    signalled jobs are real torchrun launches, the runs that only train to the end need not be)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        testing.run_distributed(signal_run.main, [str(root), str(out), *extra], nprocs=2, timeout=600)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    return _to_end(tmp / "ckpt", tmp / "clean.st", "--step-s", "0")


def _start_and_signal(root, target, signum, *, step_s, after_updates=4, stop_check_s=1.0):
    """Start the job, wait for both ranks and a few updates, signal ``target``; return (seconds to exit, last update seen, output)."""
    proc = subprocess.Popen(
        _torchrun(root, root / "never.st", "--step-s", str(step_s), "--stop-check-s", str(stop_check_s)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    pids, lines, update = {}, [], 0
    try:
        deadline = time.monotonic() + helpers.scaled(600)  # waits for an event; this only bounds a hang
        while update < after_updates or len(pids) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
            if line.startswith("ready"):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
            elif line.startswith("update"):
                update = int(line.split()[1])
        # slurm: scancel and the time limit signal every process of the step, torchrun included, which then
        # forwards its own copy to the workers milliseconds later
        for pid in {
            "torchrun": [proc.pid],
            "all": list(pids.values()),
            "rank1": [pids[1]],
            "slurm": [*pids.values(), proc.pid],
        }[target]:
            os.kill(pid, signum)
        sent = time.monotonic()
        rest, _ = proc.communicate(timeout=helpers.scaled(60))
        return time.monotonic() - sent, update, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["torchrun", "all", "rank1", "slurm"])
def test_sigterm_to_torchrun(tmp_path, uninterrupted, target):
    """SLURM/Kubernetes send SIGTERM, then SIGKILL 30 s later: the job stops at a step boundary within a few
    seconds (on every rank, when only one saw it), writes its final checkpoint, and a resumed job ends bit for bit
    where the uninterrupted one does."""
    from safetensors.torch import load_file

    root = tmp_path / "ckpt"
    seconds, _, output = _start_and_signal(root, target, signal.SIGTERM, step_s=0.05)

    assert seconds < helpers.scaled(15), output[-3000:]  # on a quiet machine; a busy one is slower at everything
    assert "stopped" in output and "signal SIGTERM" in output, output[-3000:]
    assert [f"ckpt-{int(output.split('stopped', 1)[1].split()[0]):010d}"] == [p.name for p in list_checkpoints(root)], (
        output[-3000:]
    )

    resumed = _to_end(root, tmp_path / "resumed.st")
    testing.assert_params_equal(load_file(str(uninterrupted)), load_file(str(resumed)))


@pytest.mark.multiprocess
def test_the_stop_is_agreed_within_seconds_not_updates(tmp_path):
    """Updates of 0.5 s, a signal on one rank: every rank stops within two agreement rounds (1 s each) and a
    few updates, long before 50 updates (25 s, past torchrun's 30 s grace with the save)."""
    root = tmp_path / "ckpt"
    seconds, seen, output = _start_and_signal(root, "rank1", signal.SIGTERM, step_s=0.25, after_updates=2)

    stopped_at = int(output.split("stopped", 1)[1].split()[0])
    assert stopped_at - seen <= 8, output[-3000:]  # 2 rounds + the update in progress: ~3 s of 0.5 s updates
    assert seconds < helpers.scaled(12), output[-3000:]
    assert list_checkpoints(root)[-1].name.startswith(f"ckpt-{stopped_at:010d}"), output[-3000:]
