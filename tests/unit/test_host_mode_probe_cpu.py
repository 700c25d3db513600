"""CPU tier: the host-mode probe's clock samples (tools/probes/host_mode_probe.py), which the device
runs: the SM clock it prints for a state is the median of the samples taken inside that state's
bursts, none where no sample falls inside."""

from __future__ import annotations

from tools.probes.host_mode_probe import STATES, Clocks


def test_the_clock_of_a_state_is_the_median_of_the_samples_inside_its_bursts():
    c = Clocks()
    c.samples = [(0.5, 900.0), (1.1, 1980.0), (1.2, 1700.0), (1.3, 1800.0), (2.5, 345.0), (3.05, 1600.0)]
    assert c.during([(1.0, 1.25), (3.0, 3.1)]) == 1700.0  # 1980, 1700, 1600
    assert c.during([(1.0, 1.35)]) == 1800.0
    assert c.during([(4.0, 5.0)]) is None
    assert c.during([]) is None


def test_the_probe_times_the_three_states_it_documents():
    import tools.probes.host_mode_probe as probe

    assert STATES == ("after idle", "after GPU load", "host alone")
    assert all(state in probe.__doc__ for state in STATES)
