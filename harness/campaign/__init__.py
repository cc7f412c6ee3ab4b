"""A campaign: golden runs, then every trial in a world (`run`), recovery after an alarm
(`recovery`), and the timed runs behind overhead.csv (`overhead`)."""
