use kiln::writer;

#[writer(name = "mine")]
struct NotAWriter;

fn main() {}
