"""log-errors: count the lines of one level and one service in a log file (one grep).

Log lines read `2024-05-DD HH:MM:SS LEVEL service: message`. Messages
mention other services by name (without the colon), so matching the service
word alone over-counts; the oracle matches ` LEVEL service:` exactly.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import COUNT_CHECKS, Combo, Family, TaskSpec

LOGS = ("app.log", "server.log", "system.log", "events.log", "daemon.log", "access.log")
SERVICES = ("auth", "billing", "cache", "db", "gateway", "mailer", "search", "worker")
LEVELS = ("ERROR", "WARN", "INFO")
OUTPUTS = ("count.txt", "errors.txt", "result.txt", "answer.txt", "total.txt", "lines.txt")
MESSAGES = (
    "request failed",
    "timeout talking to {other}",
    "retrying {other} call",
    "cache miss",
    "connection reset",
    "slow response from {other}",
    "job done",
    "disk almost full",
)


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    log, service, level, out = combo["log"], combo["service"], combo["level"], combo["out"]
    lines, count = [], 0
    while count == 0:  # at least one matching line, so "0" is never right by luck
        lines, count = [], 0
        for second in range(rng.randint(25, 40)):
            line_level = level if rng.random() < 0.3 else rng.choice(LEVELS)
            line_service = service if rng.random() < 0.35 else rng.choice(SERVICES)
            message = rng.choice(MESSAGES).format(other=rng.choice(SERVICES))
            stamp = f"2024-05-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{second // 60:02d}:{second % 60:02d}"
            lines.append(f"{stamp} {line_level} {line_service}: {message}")
            count += line_level == level and line_service == service
    return TaskSpec(
        instruction=(
            f"Count the lines of /app/logs/{log} whose level is {level} and whose service is {service}, "
            f"and write just that number to /app/{out}. "
            f"Each log line looks like `2024-05-01 12:00:00 LEVEL service: message`."
        ),
        app_files={f"logs/{log}": "\n".join(lines) + "\n"},
        solution=[f"grep -c ' {level} {service}:' /app/logs/{log} > /app/{out}"],
        expected={"out": f"/app/{out}", "count": count},
    )


CHECKS = COUNT_CHECKS

FAMILY = Family(
    name="log-errors",
    description="Count the log lines of one level and one service.",
    category="log-analysis",
    difficulty="easy",
    discovery=False,
    pools={"log": LOGS, "service": SERVICES, "level": LEVELS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
