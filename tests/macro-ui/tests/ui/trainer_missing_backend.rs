use kiln::{trainer, TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};

macro_rules! stub {
    ($t:ident) => {
        impl Trainer for $t {
            fn new(_: &TrainConfig) -> Result<Self, TrainError> {
                Ok($t)
            }
            fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
                unimplemented!()
            }
        }
    };
}

#[trainer(task = "sft")]
struct NoBackend;
stub!(NoBackend);

fn main() {}
