"""The run's side (``delegation.run``): what a runner sees through its context, its step
journal, replay fidelity, exact emits, steers and waits.
"""
