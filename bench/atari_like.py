"""Frames that compress like Atari screens: walls, bricks, score digits and moving sprites.

Noise would not compress at all and blank screens compress without limit; either makes a
codec comparison meaningless. These screens are rendered the way Breakout's are, so the
ratios and decode costs measured on them are the ones pixel-RL users see.
"""

from __future__ import annotations

import numpy as np

SIDE = 84
STACK = 4

# 3×5 bitmaps of the digits 0-9, one row of three bits per line.
DIGITS = [
    "111101101101111",
    "010110010010111",
    "111001111100111",
    "111001111001111",
    "101101111001001",
    "111100111001111",
    "111100111101111",
    "111001001001001",
    "111101111101111",
    "111101111001111",
]


SPRITE = np.array([[0, 1, 1, 1, 0], [1, 0, 1, 0, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 1]], np.uint8)


def _background(rng: np.random.Generator) -> np.ndarray:
    screen = np.zeros((SIDE, SIDE), np.uint8)
    screen[8:10, :] = 142  # top wall
    screen[8:, :2] = 142  # side walls
    screen[8:, -2:] = 142
    shades = (200, 180, 160, 140, 120, 100)
    for row, shade in enumerate(shades):
        top = 16 + 3 * row
        screen[top : top + 2, 2:-2] = shade
        screen[top : top + 2, 2:-2:6] = shade // 2  # brick edges
        for gap in rng.choice(np.arange(2, SIDE - 6, 6), size=rng.integers(0, 5), replace=False):
            screen[top : top + 2, gap : gap + 6] = 0  # bricks already hit
    return screen


def _draw_score(screen: np.ndarray, score: int) -> None:
    for place, digit in enumerate(f"{score % 1000:03d}"):
        bits = np.array([int(b) for b in DIGITS[int(digit)]], np.uint8).reshape(5, 3)
        left = 4 + place * 4
        screen[1:6, left : left + 3] = bits * 214


def frames(n: int, seed: int = 0, episode_length: int = 400) -> np.ndarray:
    """``n`` consecutive single frames [n, 84, 84] of one env, with episodes of a given length."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, SIDE, SIDE), np.uint8)
    background = _background(rng)
    ball = np.array([50.0, 40.0])
    velocity = np.array([1.7, 1.3])
    paddle = 40
    for t in range(n):
        if t % episode_length == 0:
            background = _background(rng)
        screen = background.copy()
        _draw_score(screen, t // 7)
        ball += velocity
        for axis, (low, high) in enumerate(((12, 78), (3, 80))):
            if not low <= ball[axis] <= high:
                velocity[axis] = -velocity[axis]
                ball[axis] = np.clip(ball[axis], low, high)
        for k in range(6):  # invaders drifting across the middle of the screen
            ix = int(3 + (t * (k + 1) // 3 + 13 * k) % (SIDE - 10))
            iy = 38 + 5 * (k % 3) + (t // 16) % 4
            screen[iy : iy + 4, ix : ix + 5] = SPRITE * (90 + 20 * k)
        screen[70:76, 2:-2] = (np.arange(2, SIDE - 2) * 37 + t // 5) % 3 * 40  # scrolling ground
        y, x = ball.astype(int)
        screen[y : y + 2, x : x + 2] = 236
        paddle = int(np.clip(paddle + rng.integers(-3, 4), 4, SIDE - 14))
        screen[79:81, paddle : paddle + 10] = 200
        out[t] = screen
    return out


def rollout(steps: int, envs: int, episode: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    """``steps`` steps of ``envs`` envs as a frame-stacking collector stores them: ``obs``
    and ``next_obs`` stacks ``[steps, envs, 84, 84, STACK]`` (HWC, newest last; an
    episode's first stack repeats its first frame, its last ``next_obs`` is the final
    observation) and ``terminated`` ``[steps, envs]``, episodes of ``episode`` steps."""
    single = np.stack([frames(steps + 1, seed=seed + e, episode_length=episode) for e in range(envs)], 1)
    t = np.arange(steps)
    start = (t - t % episode)[:, None]
    back = np.arange(STACK - 1, -1, -1)
    out = {}
    for key, shift in (("obs", 0), ("next_obs", 1)):
        index = np.maximum(t[:, None] + shift - back, start)  # [steps, STACK]
        out[key] = np.ascontiguousarray(single[index].transpose(0, 2, 3, 4, 1))
    out["terminated"] = np.repeat(((t + 1) % episode == 0)[:, None], envs, 1)
    return out
