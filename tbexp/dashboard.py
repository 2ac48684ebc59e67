"""The command `python -m tbexp.dashboard [STORAGE]`: the Optuna dashboard over a study (the code: tbexp/study/dashboard.py)."""

from tbexp.study.dashboard import main

if __name__ == "__main__":
    main()
