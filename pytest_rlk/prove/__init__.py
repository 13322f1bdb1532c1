"""Gates proven: injected faults (``faults``), their registry (``registry``), the runs that show
which gates catch them and by how much (``runner``), and ``rlk prove`` (``cli``)."""
