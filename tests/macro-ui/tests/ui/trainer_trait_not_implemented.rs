use kiln::trainer;

#[trainer(task = "sft", backend = "candle")]
struct NotATrainer;

fn main() {}
