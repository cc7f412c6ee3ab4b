"""What a run is: the validated dataclasses every layer reads (`schema`), and their construction
from the composed Hydra config (`load`), which checks every key before any process starts."""
