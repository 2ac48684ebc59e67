"""One episode and what is made of it: the policy that acts, the rollout in a sandbox, the verifier and its
verdict, the reward, the group scores and advantages GRPO trains on, and the trajectories SFT learns from."""
