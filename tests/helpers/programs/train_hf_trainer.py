"""The Transformers Trainer's training program (``control.py`` says how to run it): ``save_steps=1`` with
``AsyncCheckpointCallback`` (``checkpoint-<step>``)."""
from transformers import Trainer, TrainerCallback, TrainingArguments

from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
from control import announce, die_if_asked, keep, keep_reference, mode, model, root, steps, toy


class Report(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"START {state.global_step}", flush=True)
        control.should_training_stop = mode == "resume"

    def on_save(self, args, state, control, **kwargs):
        print(f"SAVED checkpoint-{state.global_step}", flush=True)
        announce(state.global_step)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == 1:
            keep_reference(model, optimizer)  # checkpoint-1 is saved after this
        if state.global_step == 2:
            die_if_asked("next step")  # after step 2's optimizer step


args = TrainingArguments(output_dir=root, per_device_train_batch_size=2, max_steps=steps, save_steps=1,
                         save_total_limit=keep, report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
trainer = Trainer(model=toy.Net(model()), args=args, train_dataset=toy.Endless(),
                  callbacks=[AsyncCheckpointCallback(), Report()])
trainer.train(resume_from_checkpoint=mode == "resume")
