"""Stop: why a run (or an epoch) stops here, as one value on the state."""

from __future__ import annotations

import attrs

from trainfold._src.base.records import register_record


@register_record
@attrs.frozen
class Stop:
    """Why the state says stop, and what the stop means: ``state.stop`` (None while the run goes on).

    One value, set where the decision is made (``max_steps``, ``early_stop``, ``nan_guard``, a
    signal, ``stop_when``, your code: ``state.with_stop(...)``) and read by every combinator.
    Whether the stop fell inside an epoch is the state's, not the stop's: ``state.batch_in_epoch``
    (``state.interrupted``, ``state.ended_mid_epoch``). Ending an epoch early and going on
    (``stop_when(..., end="epoch")``) is not a stop of the run: ``state.end_of_epoch``.

    Attributes:
        reason: who stopped it: ``"max_steps"``, ``"early_stop:<metric>"``, ``"nan_guard"``,
            ``"signal SIGTERM"``... ("" for none given).
        final: the stop is where this invocation was meant to end (a step budget,
            ``stop_when``'s condition), not a preemption: ``run_epoch`` leaves the epoch open but
            not interrupted, so the epoch functions composed after it (``evaluate``, ``save_best``,
            ``log_epoch``, ``save_checkpoint``) record and save the final model. A signal or
            ``nan_guard`` stop is not final.
        finished: the run is over for good (``early_stop`` decided it converged): a run resumed
            from its checkpoint stays stopped. A stop that only ends this invocation (a budget,
            a signal) is not carried into a resumed run, which goes on.

    Examples:
        >>> Stop("max_steps", final=True)
        Stop(reason='max_steps', final=True, finished=False)
    """

    reason: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    final: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    finished: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
