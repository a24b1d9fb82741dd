use kiln::writer;

#[writer(name = "GGUF")]
struct Upper;

fn main() {}
