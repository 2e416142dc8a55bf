"""A check every backend's ``tol`` passes at the last bit of a loss difference."""

import numpy as np

from stepfuse import Stop


def assert_tol_stops_where_the_recorded_losses_say(run, losses, at=(20, 40)):
    """``run(tol)`` makes a fresh fit with that ``tol`` and returns its `Trace`; ``losses``
    are the same fit's losses without ``tol``. For ``tol`` equal to a recorded difference
    and an ulp either side, the loop stops exactly where its own recorded losses first meet
    ``tol``, and records the same losses up to there.

    (XLA fuses a loss's last operation into the comparison with the loss before and may
    round that copy differently, an FMA, from the one recorded; a loop comparing that copy
    stopped a step early or late for about half of these tols.)
    """
    losses = np.asarray(losses)
    diffs = np.abs(np.diff(losses.astype(np.float64)))
    for i in at:
        for tol in (diffs[i], np.nextafter(diffs[i], 0), np.nextafter(diffs[i], 1)):
            trace = run(float(tol))
            recorded = np.asarray(trace.loss)
            np.testing.assert_array_equal(recorded, losses[: len(recorded)])
            met = np.nonzero(np.abs(np.diff(recorded.astype(np.float64))) <= tol)[0]
            assert trace.stop is Stop.TOL and len(met) == 1 and trace.steps == met[0] + 2, (
                i,
                tol,
                trace,
            )
