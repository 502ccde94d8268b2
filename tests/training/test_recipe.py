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


def test_per_gpu_batches_keep_each_boxes_batch_and_grow_the_step_with_the_boxes() -> None:
    # 500k photos on 4 boxes: each GPU keeps the batch of one, a step takes 4 times as many
    # images, a quarter of the steps an epoch.
    one = choose_recipe(500_000, photos=True)
    four = choose_recipe(500_000, photos=True, request=RecipeRequest(nodes=4))
    assert four.batch_size == one.batch_size == 128
    assert four.steps_per_epoch == 500_000 // (128 * 4)
    assert four.learning_rate == one.learning_rate  # one GPU's: the box scales it
    assert "128 a GPU, 512 a step over 4 boxes" in four.reason
    # The optimizer is the one box's (SGD: 23,436 steps at batch 128), its rate x4 (linear).
    assert four.optimizer == one.optimizer == "sgd"
    assert "x4 over 4 boxes (linear rule" in four.reason
    # A small set on several boxes: the per-GPU batch shrinks to keep 8 steps an epoch.
    digits = choose_recipe(1437, photos=False, request=RecipeRequest(nodes=2))
    assert digits.batch_size == 64 and digits.steps_per_epoch == 1437 // 128
    # global: the batch is all the boxes' together, the steps as on one.
    whole = choose_recipe(
        1437, photos=False, request=RecipeRequest(nodes=2, batch_scaling="global")
    )
    assert whole.batch_size == 128 and whole.steps_per_epoch == 1437 // 128
    assert "a GPU" not in whole.reason


def test_the_rate_follows_the_ranks_by_the_optimizers_rule() -> None:
    from burstcv.training.recipe import learning_rate_for, world_lr_factor

    assert world_lr_factor("sgd", 4) == 4.0  # linear (Goyal et al.)
    assert world_lr_factor("adamw", 4) == 2.0  # square root
    assert world_lr_factor("adamw", 1) == 1.0
    for optimizer in ("sgd", "adamw"):
        # One GPU's rate, scaled for 8 ranks, is the rate the rule gives their global batch.
        assert learning_rate_for(optimizer, 64) * world_lr_factor(optimizer, 8) == pytest.approx(
            learning_rate_for(optimizer, 512)
        )
    with pytest.raises(ValueError, match="at least one rank"):
        world_lr_factor("sgd", 0)


def test_the_rules_bounds_hold_at_their_edges() -> None:
    # 1,024 images: batch 128 is exactly 8 steps an epoch, the fewest allowed.
    edge = choose_recipe(1024, photos=False)
    assert (edge.batch_size, edge.steps_per_epoch) == (128, 8)
    assert choose_recipe(1, photos=False).batch_size == 8  # one image still trains
    five = choose_recipe(5, photos=True)  # fewer images than the smallest batch: one step
    assert (five.batch_size, five.steps_per_epoch, five.epochs) == (8, 1, 30)
    assert "5 training images: 1 steps an epoch" in five.reason
    assert "AdamW (30 steps at batch 8" in five.reason
    over = choose_recipe(5, photos=True, request=RecipeRequest(batch_size=64, nodes=2))
    assert over.steps_per_epoch == 1
    # SGD from 10,000 steps on (1,000 steps an epoch for 10 epochs), AdamW below.
    assert choose_recipe(128_000, photos=True, request=RecipeRequest(epochs=10)).optimizer == "sgd"
    below = choose_recipe(127_999, photos=True, request=RecipeRequest(epochs=10))
    assert below.optimizer == "adamw" and "9,990 steps at batch 128: under 10,000" in below.reason
    # The warm-up cap: max(3 epochs, 100 steps); 300 photos for 60 epochs are 540 steps.
    long = choose_recipe(300, photos=True, request=RecipeRequest(epochs=60))
    assert long.warmup_steps == 100
    # Patience: a quarter of the epochs, at least 4.
    assert (
        choose_recipe(300, photos=True, request=RecipeRequest(epochs=30)).early_stop_patience == 8
    )
    assert choose_recipe(300, photos=True, request=RecipeRequest(epochs=6)).early_stop_patience == 4


def test_the_reason_says_every_choice_in_one_line() -> None:
    assert choose_recipe(1437, photos=False).reason == (
        "model resnet10 (small images); batch 128 (1437 training images: 11 steps an epoch, "
        "at least 8 wanted, at most 128); 6 epochs (8,622 images seen, 4,500 wanted, 6-30 "
        "epochs); AdamW (66 steps at batch 128: under 10,000); learning rate 0.002 (0.001 at "
        "batch 32 x sqrt(128/32)); warm-up 16 steps (a quarter of the run, at most 100); early "
        "stop after 4 epochs without improvement; cosine decay over 66 steps"
    )
    sgd = choose_recipe(
        1437, photos=True, request=RecipeRequest(optimizer="sgd", nodes=2, model="resnet18")
    )
    assert sgd.reason == (
        "batch 64 a GPU, 128 a step over 2 boxes (1437 training images: 11 steps an epoch, "
        "at least 8 wanted, at most 128); 6 epochs (8,622 images seen, 4,500 wanted, 6-30 "
        "epochs); learning rate 0.025 (0.1 x 64/256); rate 0.025 a GPU, x2 over 2 boxes "
        "(linear rule; each box's GPUs scale it further); warm-up 16 steps (a quarter of the "
        "run, at most 100); early stop after 4 epochs without improvement; cosine decay over "
        "66 steps"
    )
