"""What a job does around its stages: launching (local or SLURM), tracking and plots, the training schedule,
and stopping cleanly when preempted."""
