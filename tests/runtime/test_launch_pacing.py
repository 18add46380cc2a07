"""Launch pacing (engine/launch_pacing.py): the hold it allows, from the step times it measured, and
what it buys a server, checked on a simulated device and host clock: requests arriving while a step
runs join the next step instead of the one after, and the device is not left idle."""

from __future__ import annotations

import random

import pytest
from qruntime.engine.launch_pacing import LaunchPacer, PacingConfig, bucket, step_key


def _measured(pacer: LaunchPacer, key, durations, start: float = 1.0) -> float:
    """Feed `durations` as back-to-back steps of shape `key`, each read while it runs; returns the
    time the last one was seen ending."""
    end = start
    pacer.completed(key, start - 1e-3, start - 1e-2, end)  # a first step seen ending at `start`
    for duration in durations:
        queued = end - 1e-3  # queued while the step before ran
        pacer.completed(key, queued, end + 1e-4, end + duration)  # the read began just after that step's end
        end += duration
    return end


def test_buckets_and_keys():
    assert [bucket(n) for n in (0, 1, 2, 3, 16, 17, 2048)] == [0, 1, 2, 4, 16, 32, 2048]
    assert step_key(32, 0, 0) == (32, 0, 0)  # a decode step of 32 rows
    assert step_key(2048, 32, 32 * 2064) == (2048, 32, 512)  # 32 chunks ending at position 2064: 258 x 256


def test_hold_ends_the_launch_time_and_margin_before_the_estimated_end():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    cfg = PacingConfig()
    pacer = LaunchPacer(cfg)
    key = step_key(rng.randrange(1, 256), 0, 0)
    durations = [rng.uniform(4e-3, 12e-3) for _ in range(5)]
    end = _measured(pacer, key, durations)
    assert pacer.estimate(key) == pytest.approx(cfg.safety * min(durations[-2:]), rel=1e-9)
    leads = [rng.uniform(3e-4, 2e-3) for _ in range(cfg.lead_window + 4)]
    for lead in leads:  # launches whose host work took `lead` each
        pacer.launched(10.0, 10.0 + lead)
    longest = max(leads[-cfg.lead_window :])  # the launches before those are forgotten
    queued, now = end - 2e-3, end + 3e-4  # the step in flight: queued before the last one ended
    hold = pacer.hold(key, queued, now)
    expected = end + cfg.safety * min(durations[-2:]) - longest - cfg.margin_s - now
    assert hold == pytest.approx(expected, rel=1e-9)
    assert cfg.min_hold_s <= hold <= cfg.max_hold_s
    # the next launch's host time runs from the end of that hold
    pacer.launched(now, now + hold + 2.5e-3)
    assert pacer.hold(key, queued, now) == pytest.approx(expected + longest - 2.5e-3, rel=1e-9)


def test_no_hold_without_a_measured_shape_a_known_start_or_room():
    cfg = PacingConfig()
    pacer = LaunchPacer(cfg)
    key, other = step_key(32, 0, 0), step_key(96, 2, 2000)
    end = _measured(pacer, key, [8e-3, 8e-3])
    pacer.launched(0.0, 1e-3)
    assert pacer.hold(key, end, end) > 0.0
    assert pacer.hold(other, end, end) == 0.0  # never measured
    assert pacer.hold(key, end, end + 8e-3) == 0.0  # past the estimated end
    # a step whose read did not wait: it ended before the host looked, at an unknown time
    pacer.completed(key, end, end + 9e-3, end + 9e-3 + cfg.blocked_s / 2)
    assert pacer.hold(key, end + 9e-3, end + 9e-3) == 0.0
    # the next read that waits gives a start again, but no duration for the step after the unknown end
    before = pacer._durations[key]
    pacer.completed(key, end + 9e-3, end + 1e-2, end + 2e-2)
    assert pacer._durations[key] == before
    assert pacer.hold(key, end + 2e-2, end + 2e-2) > 0.0


def test_holds_are_capped():
    cfg = PacingConfig(max_hold_s=2e-3)
    pacer = LaunchPacer(cfg)
    key = step_key(8, 0, 0)
    end = _measured(pacer, key, [0.5, 0.5])
    pacer.launched(0.0, 1e-3)
    assert pacer.hold(key, end, end) == cfg.max_hold_s


@pytest.mark.parametrize(
    "field, value", [("safety", 0.0), ("safety", 1.5), ("lead_window", 0), ("margin_s", -1.0), ("blocked_s", -1e-3)]
)
def test_config_refuses_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        PacingConfig(**{field: value})


def _serve(pacing: bool, rng: random.Random, arrivals: list[float], step_s: float, host_s: float) -> tuple:
    """A server on a simulated clock: the device runs queued steps back to back, each `step_s` long
    (+-3%); the host loop holds (when pacing), takes in the arrivals so far, spends `host_s` queuing
    the next step, then reads the step before (waiting for it) and spends 0.3 ms on its results, as
    EngineLoop does around Engine.step. Returns (each arrival's time to the end of the step it
    joined, the device's idle time between steps while there was work, the steps run)."""
    pacer = LaunchPacer()
    key = step_key(32, 0, 0)
    pending = sorted(arrivals)
    t, device_free, in_flight = 0.0, 0.0, None  # in_flight: (queued at, ends at, arrivals it carries)
    ttft, idle, steps = [], 0.0, 0
    while pending or in_flight is not None:
        if pacing and in_flight is not None:
            t += pacer.hold(key, in_flight[0], t)
        joined = [a for a in pending if a <= t]
        pending = pending[len(joined) :]
        started = t
        t += host_s
        duration = step_s * rng.uniform(0.97, 1.03)
        begin = max(t, device_free)
        if steps:
            idle += begin - device_free
        device_free, steps = begin + duration, steps + 1
        pacer.launched(started, t)
        launched = (t, device_free, joined)
        if in_flight is not None:
            read_at = t
            t = max(t, in_flight[1]) + 2e-5
            pacer.completed(key, in_flight[0], read_at, t)
            ttft += [in_flight[1] - a for a in in_flight[2]]
            t += 3e-4
        in_flight = launched
        if not pending and not launched[2] and steps > 2:  # the load is over once no request waits
            ttft += [in_flight[1] - a for a in in_flight[2]]
            break
    return ttft, idle, steps


def test_a_paced_server_takes_arrivals_a_step_sooner_and_keeps_the_device_busy():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    step_s, host_s = rng.uniform(5e-3, 15e-3), rng.uniform(5e-4, 1.5e-3)
    arrivals = sorted(rng.uniform(0.02, 0.02 + 200 * step_s) for _ in range(300))
    plain, plain_idle, plain_steps = _serve(False, random.Random(seed), arrivals, step_s, host_s)
    paced, paced_idle, paced_steps = _serve(True, random.Random(seed), arrivals, step_s, host_s)
    assert len(plain) == len(paced) == len(arrivals)
    mean_plain, mean_paced = sum(plain) / len(plain), sum(paced) / len(paced)
    print(f"step {step_s * 1e3:.2f} ms, host {host_s * 1e3:.2f} ms: time to first token {mean_plain * 1e3:.2f} -> "
          f"{mean_paced * 1e3:.2f} ms; device idle {plain_idle * 1e3:.3g} -> {paced_idle * 1e3:.3g} ms over "
          f"{plain_steps} / {paced_steps} steps")  # fmt: skip
    # without pacing an arrival waits the rest of the step in flight and the next two; with it, most wait
    # one (those arriving in the window between the plain launch and the held one: 50-70% of a step here)
    assert mean_paced < mean_plain - 0.3 * step_s
    # nor is the device starved for it: the estimates (85% of the step, which varies by 3%) end before it does
    assert paced_idle == 0.0
