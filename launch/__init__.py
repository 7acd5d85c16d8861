"""pipeflow-launch: a plan and a host list to an mpirun command."""
