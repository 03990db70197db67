"""``pdserve bench faults``: each kind of process SIGKILLed under load, in turn, and what the
clients saw (``cli``), with the census of what a cluster still holds afterwards (``leaks``)."""
