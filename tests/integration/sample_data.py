"""The bundled sample data, fewer of each (CI time): the same two labelled sources. The tiny
target's drafters saturate at an eighth of the full set (`eagle-ray curve` on the demo)."""

from eagle_ray.job.pipeline import SAMPLE_DATA


def small_sample_data(personal: int = 200, general: int = 150) -> list[str]:
    mine, theirs = SAMPLE_DATA[0], SAMPLE_DATA[1].split(":")[0]
    return [f"{mine}:{personal}", f"{theirs}:{general}::general"]
