"""The course's machinery: what the lessons use to measure, judge, check and run the models, kept
apart from the models themselves (no module outside `lib.course` imports from here, except the
package root `lib`, which plugs in the training replay cache; tests/project/test_layers.py checks).

    bench            benchmarks (`python -m lib.course.bench.<name>`), one timer, machine records
    claims           the ledger: each checked claim, its verdict, and the evidence
    compare          lesson 08's comparison: its model configurations and the seed judging
    precision        numbers printed at the precision they have; float64 scopes
    doctor           the capability check each lesson starts with
    lessons          the lesson map: titles, times, what a CPU and a GPU do, class sizing
    hosted           setting up a hosted runtime (Colab, a class hub)
    demos            the small trained models the classroom gallery's widgets draw
    exercises        each lesson's exercise checks and build track checks, with hints
    training_cache   replaying a training run made before (ONEMASK_TRAINING_CACHE)
"""
