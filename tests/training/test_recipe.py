"""The training recipe follows the data: enough steps, a rate scaled with the batch, auto only."""

from __future__ import annotations

import math

import pytest

from burstcv.training.recipe import RecipeRequest, choose_recipe


def test_the_issues_photo_set_gets_the_recipe_that_trained_it() -> None:
    # 5 classes x 60 training photos: the issue's user trained it well with batch 32 and
    # 15 epochs (AdamW 1e-3, cosine), not with the digits' batch 128 (2 steps an epoch).
    recipe = choose_recipe(300, photos=True)
    assert (recipe.model, recipe.batch_size, recipe.epochs) == ("resnet18", 32, 15)
    assert recipe.steps_per_epoch == 9
    assert recipe.optimizer == "adamw" and recipe.learning_rate == pytest.approx(1e-3)
    assert 0 < recipe.warmup_steps <= 9 * 15 // 4 + 1
    assert set(recipe.derived) == {
        "model",
        "batch_size",
        "epochs",
        "optimizer",
        "learning_rate",
        "warmup_steps",
        "early_stop_patience",
    }
    assert "batch 32" in recipe.reason and "15 epochs" in recipe.reason
    assert "\n" not in recipe.reason


def test_the_digits_keep_a_batch_of_128_for_six_epochs() -> None:
    recipe = choose_recipe(1437, photos=False)
    assert (recipe.model, recipe.batch_size, recipe.epochs) == ("resnet10", 128, 6)
    assert recipe.steps_per_epoch == 11
    # AdamW's rate grows with the square root of the batch.
    assert recipe.learning_rate == pytest.approx(1e-3 * math.sqrt(128 / 32))


def test_explicit_values_win_and_the_rate_follows_an_explicit_batch() -> None:
    recipe = choose_recipe(
        300, photos=True, request=RecipeRequest(batch_size=64, epochs=3, model="resnet10")
    )
    assert (recipe.model, recipe.batch_size, recipe.epochs) == ("resnet10", 64, 3)
    assert "batch_size" not in recipe.derived and "model" not in recipe.derived
    assert recipe.learning_rate == pytest.approx(1e-3 * math.sqrt(2))
    sgd = choose_recipe(300, photos=True, request=RecipeRequest(optimizer="sgd"))
    assert sgd.learning_rate == pytest.approx(0.1 * 32 / 256)  # torchvision: 0.1 per 256
    fixed = choose_recipe(300, photos=True, request=RecipeRequest(learning_rate=0.5))
    assert fixed.learning_rate == 0.5 and "learning_rate" not in fixed.derived


def test_long_runs_train_with_sgd_and_a_tiny_set_still_gets_steps() -> None:
    big = choose_recipe(1_000_000, photos=True)
    assert big.optimizer == "sgd" and big.batch_size == 128 and big.epochs == 6
    assert big.learning_rate == pytest.approx(0.05)
    total = big.steps_per_epoch * big.epochs
    assert big.warmup_steps == round(total / 4)  # under 3 epochs (Ultralytics' warm-up)
    sixty = choose_recipe(1_000_000, photos=True, request=RecipeRequest(epochs=60))
    assert sixty.warmup_steps == 3 * sixty.steps_per_epoch  # capped at 3 epochs
    tiny = choose_recipe(40, photos=True)
    assert tiny.batch_size == 8 and tiny.epochs == 30  # the floor and the cap
    with pytest.raises(ValueError, match="no training image"):
        choose_recipe(0, photos=True)
